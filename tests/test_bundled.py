"""The bundled trained model: Hugging Face compatibility and lossless speculation on real prompts.

The equality and sampling checks also run with the target on a GPU (`gpu` marker, run by
bench/gpu_check.sh): through torch SDPA in float32 and through FlashInfer's custom mask in float16."""

from __future__ import annotations

import json

import pytest
import torch

from entmtp_sglang.engine.engine import Engine, static_chooser
from entmtp_sglang.engine.plain import generate_plain
from entmtp_sglang.engine.sampling import SamplingParams
from entmtp_sglang.kernels import flashinfer_available
from entmtp_sglang.model.load import BUNDLED_MODEL
from entmtp_sglang.tasks import load_prompts
from entmtp_sglang.tree import Tree, from_medusa_choices, from_sglang

BRANCHING = [
    from_sglang(3, 4, 10),
    from_medusa_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]),
    Tree((-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8)),
]
TREES = [Tree.chain(d) for d in range(1, 6)] + BRANCHING

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_flashinfer = pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed "
                                 "(bench/gpu_check.sh brings it)")
# where the target runs: (device, dtype, attention backend, near-tie tolerance in logits)
PATHS = {"cpu": ("cpu", torch.float32, "auto", 0.0),
         "cuda-sdpa": ("cuda", torch.float32, "torch", 1e-3),
         "cuda-flashinfer": ("cuda", torch.float16, "flashinfer", 0.1)}
ON = [pytest.param("cpu"), pytest.param("cuda-sdpa", marks=[pytest.mark.gpu, _cuda]),
      pytest.param("cuda-flashinfer", marks=[pytest.mark.gpu, _cuda, _flashinfer])]


def target_on(path: str, target):
    """The target as the engine sees it on `path`: itself on the CPU, or a copy on CUDA (float32 through torch
    SDPA, float16 through FlashInfer's custom mask) that hands float32 host tensors to the CPU drafters."""
    device, dtype, attention, _ = PATHS[path]
    if device == "cpu":
        return target
    from entmtp_sglang.model.on_device import TargetOnDevice

    return TargetOnDevice(target, device, dtype, attention=attention)


def assert_greedy_equal(got: list[list[int]], ref: list[list[int]], target, prompts, path: str, label: str) -> None:
    """Token-for-token equality; on a GPU path, a divergence is allowed only where plain decoding's top-2
    logits are within the path's tolerance (a near-tie its precision cannot decide)."""
    tol = PATHS[path][3]
    if tol == 0.0:
        assert got == ref, label
        return
    ties = 0
    for p, g, r in zip(prompts, got, ref):
        if g == r:
            continue
        i = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
        logits = target.logits(target(torch.tensor([p + r[:i]])))[0, -1]
        top = logits.float().topk(2).values
        gap = float(top[0] - top[1])
        assert gap <= tol, (f"{label}: token {i} differs ({g[i:i + 1]} vs {r[i:i + 1]}) where plain decoding's "
                            f"top-2 logit gap is {gap:.4f} > {tol}")
        ties += 1
    print(f"[{path}] {label}: {len(got) - ties}/{len(got)} outputs equal plain decoding token for token, "
          f"{ties} diverge at a near-tie")


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
@pytest.mark.parametrize("path", ON)
def test_greedy_speculation_equals_plain_quick(bundled, kind, path):
    b = bundled[kind]
    target = target_on(path, b.target)
    plans = _flashinfer_plans()
    prompts = mixed_prompts(2, b.tokenizer)  # 10 prompts across the domains
    ref = [generate_plain(target, p, 32, eos_token_id=b.eos_token_id) for p in prompts]
    engine = Engine(target, kind, b.drafter, b.eos_token_id)
    for tree in (Tree.chain(3), BRANCHING[0], BRANCHING[2]):
        out = engine.generate(prompts, 32, static_chooser(tree))  # batch 10
        assert_greedy_equal([r.output_ids for r in out], ref, target, prompts, path, f"{kind} {tree.name}")
    single = engine.generate(prompts[:1], 32, static_chooser(BRANCHING[1]))
    assert_greedy_equal([single[0].output_ids], ref[:1], target, prompts[:1], path, f"{kind} batch 1")
    if path == "cuda-flashinfer":
        assert _flashinfer_plans() > plans, "the FlashInfer path did not run"


def _flashinfer_plans() -> int:
    if not flashinfer_available():
        return 0
    from entmtp_sglang.kernels import tree_attention_flashinfer

    return tree_attention_flashinfer.plans_made


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
@pytest.mark.parametrize("path", ON)
def test_sampled_speculation_keeps_the_bundled_models_distribution(bundled, path):
    """End to end on the bundled model: the 4th sampled token's distribution, speculative vs plain."""
    b = bundled["hydra"]
    target = target_on(path, b.target)
    prompt = b.tokenizer.encode("User: Tell me a story.\nAssistant: ").ids
    params = SamplingParams(temperature=0.8, top_k=20)
    engine = Engine(target, "hydra", b.drafter, None)
    n = 600
    spec, plain = torch.zeros(4096), torch.zeros(4096)
    for seed in range(n):
        r = engine.generate([prompt], 4, static_chooser(BRANCHING[0]), params, seed=seed)[0]
        spec[r.output_ids[3]] += 1
        g = torch.Generator().manual_seed(50_000 + seed)
        plain[generate_plain(target, prompt, 4, params, generator=g)[3]] += 1
    keep = (spec + plain) >= 10
    a = torch.cat([spec[keep], spec[~keep].sum().view(1)])
    c = torch.cat([plain[keep], plain[~keep].sum().view(1)])
    stat = float((((a - c) ** 2) / (a + c).clamp(min=1)).sum())
    dof = int(keep.sum())
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                            torch.tensor(stat / 2.0, dtype=torch.float64)))
    print(f"[{path}] sampled 4th token, speculative vs plain ({n} draws each): chi-square p = {p_value:.3f}, "
          f"{dof} bins")
    assert p_value > 0.01, (p_value, dof)
