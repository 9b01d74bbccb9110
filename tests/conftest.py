"""Shared fixtures: a small random model (fast, always available) and the bundled trained model."""

from __future__ import annotations

import pytest
import torch

from entmtp_sglang.model.drafters import EagleDraft, HydraHead, MedusaHeads
from entmtp_sglang.model.eagle3 import Eagle3Draft
from entmtp_sglang.model.llama import LlamaForCausalLM, LlamaShape, init_weights
from entmtp_sglang.model.load import BUNDLED_MODEL, load_bundle
from entmtp_sglang.settings import settings


@pytest.fixture(autouse=True)
def settings_follow_the_environment(monkeypatch):
    """`ENTMTP_*` switches are read once per process (entmtp_sglang/settings.py). In a test, each
    `monkeypatch.setenv`/`delenv` drops the cached record, so the next read sees the change; every test starts and
    ends with none cached."""
    settings.cache_clear()
    for name in ("setenv", "delenv"):
        def changed(*args, _change=getattr(monkeypatch, name), **kwargs):
            _change(*args, **kwargs)
            settings.cache_clear()
        setattr(monkeypatch, name, changed)
    yield
    settings.cache_clear()


TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="session")
def random_models():
    """Random target and drafters; drafters are nudged toward the target so some drafts get accepted."""
    torch.manual_seed(0)
    shape = LlamaShape(**TINY)
    target = LlamaForCausalLM(shape)
    init_weights(target, std=0.3)
    drafters = {
        "medusa": MedusaHeads(32, 97, 5),
        "hydra": HydraHead(32, 97, 5),
        "eagle": EagleDraft(LlamaShape(**{**TINY, "num_hidden_layers": 1})),
        # fuses the residual streams entering layers 0, 1 and 1 of the 2-layer target; draft vocabulary: every
        # other token and the first ten
        "eagle3": Eagle3Draft(LlamaShape(**{**TINY, "num_hidden_layers": 1}),
                              torch.tensor(sorted(set(range(0, 97, 2)) | set(range(10)))), (0, 1, 1)),
    }
    init_weights(drafters["eagle"], std=0.3)
    init_weights(drafters["eagle3"], std=0.3)
    with torch.no_grad():
        for head in drafters["medusa"].lm_heads:
            head.weight.copy_(target.lm_head_weight + 0.05 * torch.randn_like(head.weight))
        drafters["hydra"].lm_head.weight.copy_(target.lm_head_weight)
        drafters["eagle"].embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    drafters["eagle3"].target_shared({})
    drafters["eagle3"].share_target(target)  # the target's embedding and its output rows of the draft vocabulary
    for m in [target, *drafters.values()]:
        m.eval().requires_grad_(False)
    return target, drafters


@pytest.fixture(scope="session")
def bundled():
    """The trained bundled model with each drafter (fp32)."""
    if not (BUNDLED_MODEL / "model.safetensors").exists():
        pytest.fail(f"bundled model missing at {BUNDLED_MODEL}")
    return {k: load_bundle(drafter=k) for k in ("medusa", "hydra", "eagle")}
