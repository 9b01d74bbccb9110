"""The bundled trained model: Hugging Face compatibility and lossless speculation on real prompts."""

from __future__ import annotations

import json

import pytest
import torch

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.engine.plain import generate_plain
from entmtp_sglang.engine.sampling import SamplingParams
from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tasks import load_prompts
from entmtp_sglang.tree import Tree, from_medusa_choices, from_sglang

BRANCHING = [
    from_sglang(3, 4, 10),
    from_medusa_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]),
    Tree((-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8)),
]
TREES = [Tree.chain(d) for d in range(1, 6)] + BRANCHING


def mixed_prompts(per_task: int, tokenizer, max_tokens: int = 200) -> list[list[int]]:
    """Prompts across code, JSON, prose (chat and creative) and math, test splits, tokenized."""
    out = []
    for task in ("code", "json", "prose", "chat", "math"):
        for item in load_prompts(task, "test", per_task):
            out.append(tokenizer.encode(item["prompt"]).ids[-max_tokens:])
    return out


def test_loads_in_transformers_and_matches_our_logits(bundled):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    hf = LlamaForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    ours = bundled["medusa"]
    text = 'def add(a, b):\n    return a + b\n{"name": "demo"}'
    ids = tok(text)["input_ids"]
    assert ids == ours.tokenizer.encode(text).ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        got = ours.target.logits(ours.target(torch.tensor([ids])))[0]
    assert torch.allclose(ref, got, atol=2e-4, rtol=1e-4)
    assert tok.decode(ids) == text


def test_eagle_checkpoint_uses_sglang_layout():
    from safetensors import safe_open

    cfg = json.loads((BUNDLED_MODEL / "eagle" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    with safe_open(str(BUNDLED_MODEL / "eagle" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert not any(n.startswith("model.") or "input_layernorm" in n for n in names)


def test_bundled_weights_stay_small():
    total = sum(p.stat().st_size for p in BUNDLED_MODEL.rglob("*.safetensors"))
    assert total < 40e6


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_greedy_speculation_equals_plain_quick(bundled, kind):
    b = bundled[kind]
    prompts = mixed_prompts(2, b.tokenizer)  # 10 prompts across the domains
    ref = [generate_plain(b.target, p, 32, eos_token_id=b.eos_token_id) for p in prompts]
    engine = Engine(b.target, kind, b.drafter, b.eos_token_id)
    for tree in (Tree.chain(3), BRANCHING[0], BRANCHING[2]):
        out = engine.generate(prompts, 32, static_chooser(tree))  # batch 10
        assert [r.output_ids for r in out] == ref, tree.name
    single = engine.generate(prompts[:1], 32, static_chooser(BRANCHING[1]))
    assert single[0].output_ids == ref[0]


def test_drafts_are_accepted_more_on_json_and_code_than_prose(bundled):
    b = bundled["hydra"]
    engine = Engine(b.target, "hydra", b.drafter, b.eos_token_id)
    mean = {}
    for task in ("json", "code", "chat"):
        prompts = [b.tokenizer.encode(it["prompt"]).ids[-200:] for it in load_prompts(task, "test", 4)]
        out = engine.generate(prompts, 48, static_chooser(Tree.chain(4)))
        steps = [s.accepted for r in out for s in r.steps]
        mean[task] = sum(steps) / len(steps)
    assert mean["json"] > mean["chat"] and mean["code"] > mean["chat"], mean


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_greedy_speculation_equals_plain_on_60_prompts(bundled, kind):
    """Acceptance: >= 50 prompts across code, JSON, prose and math; chains 1-5 and three branching
    trees; batch 1 and batch 8."""
    b = bundled[kind]
    prompts = mixed_prompts(11, b.tokenizer)
    assert len(prompts) >= 50
    ref = [generate_plain(b.target, p, 32, eos_token_id=b.eos_token_id) for p in prompts]
    engine = Engine(b.target, kind, b.drafter, b.eos_token_id)
    for tree in TREES:
        got = []
        for i in range(0, len(prompts), 8):
            got += [r.output_ids for r in engine.generate(prompts[i:i + 8], 32, static_chooser(tree))]
        assert got == ref, f"batch 8, {tree.name}"
        for i, p in enumerate(prompts):
            assert engine.generate([p], 32, static_chooser(tree))[0].output_ids == ref[i], f"batch 1, {tree.name}"


@pytest.mark.slow
def test_sampled_speculation_keeps_the_bundled_models_distribution(bundled):
    """End to end on the bundled model: the 4th sampled token's distribution, speculative vs plain."""
    b = bundled["hydra"]
    prompt = b.tokenizer.encode("User: Tell me a story.\nAssistant: ").ids
    params = SamplingParams(temperature=0.8, top_k=20)
    engine = Engine(b.target, "hydra", b.drafter, None)
    n = 600
    spec, plain = torch.zeros(4096), torch.zeros(4096)
    for seed in range(n):
        r = engine.generate([prompt], 4, static_chooser(BRANCHING[0]), params, seed=seed)[0]
        spec[r.output_ids[3]] += 1
        g = torch.Generator().manual_seed(50_000 + seed)
        plain[generate_plain(b.target, prompt, 4, params, generator=g)[3]] += 1
    keep = (spec + plain) >= 10
    a = torch.cat([spec[keep], spec[~keep].sum().view(1)])
    c = torch.cat([plain[keep], plain[~keep].sum().view(1)])
    stat = float((((a - c) ** 2) / (a + c).clamp(min=1)).sum())
    dof = int(keep.sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                            torch.tensor(stat / 2.0, dtype=torch.float64)))
    assert p_value > 0.01, (p_value, dof)
