"""Tiny checkpoints for the drafter layouts beyond the bundled EAGLE one, written at test time (no downloads).

    write_llama_target(DIR)              a Llama target (`LlamaForCausalLM`, 4 layers, hidden 64)
    write_eagle3_draft(DIR, TARGET)      an EAGLE-3 draft for it (`LlamaForCausalLMEagle3`): drafts from three
                                         captured target layers, over its own 2048-token vocabulary (d2t)
    write_mimo_with_mtp(DIR)             a MiMo target (`MiMoForCausalLM`, Qwen2 layers) carrying one MTP
                                         layer; SGLang serves the same directory as the draft (`MiMoMTP`), as
                                         for NEXTN

Greedy speculative output equals plain decoding whatever the draft proposes, but a random draft is never
accepted, and then the paths that commit accepted drafts (KV compaction, the draft extend over several
tokens, the draft-to-target vocabulary map) go untested. So the weights are random but shaped:

* each target is close to a bigram model: its attention and MLP outputs are small next to the token
  embedding (`MIX_STD`), so its next token is usually, not always, `bigram(token)` = argmax of
  lm_head . rmsnorm(embedding) (about 80% of greedy steps);
* each draft computes that bigram of its input token: the MTP layer projects only the token half of its
  input (`input_proj` = [0 | I]) and shares the target's embedding and head; the EAGLE-3 layer attends
  (sharply: `DRAFT_ATTN_SHARPNESS`) to its own token's embedding and amplifies it (`DRAFT_GAIN`) over the
  carried hidden state, with an lm_head of the target's rows for the tokens bigram() can produce.

So drafts are accepted often and rejected sometimes. Each checkpoint is under 3 MB (bfloat16), with the
bundled model's tokenizer. Weight names are the Hugging Face layouts SGLang 0.5.23's loaders read
(`models/llama.py`, `models/llama_eagle3.py`, `models/mimo.py`, `models/mimo_mtp.py`). Needs torch and
safetensors only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from entmtp_sglang.model.load import BUNDLED_MODEL

LLAMA_ARCH = "LlamaForCausalLM"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
MIMO_ARCH = "MiMoForCausalLM"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
INIT_STD = 0.02
MIX_STD = 0.2                  # targets' o_proj and down_proj: how far from a bigram model they stray
DRAFT_ATTN_SHARPNESS = 8.0     # EAGLE-3 draft: query = this x the key, so a token attends to itself
DRAFT_GAIN = 10.0              # EAGLE-3 draft: o_proj = this x I, so the token outweighs the carried state
RMS_EPS = 1e-6


def _save(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], tokenizer_from: Path | None) -> Path:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
              str(out_dir / "model.safetensors"))
    for name in TOKENIZER_FILES if tokenizer_from is not None else ():
        shutil.copyfile(Path(tokenizer_from) / name, out_dir / name)
    return out_dir


def _random(gen: torch.Generator, *shape: int, std: float = INIT_STD) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _decoder_layer(gen, prefix: str, hidden: int, heads: int, kv_heads: int, inter: int, *, qkv_in: int | None = None,
                   qkv_bias: bool = False, out_std: float = INIT_STD) -> dict[str, torch.Tensor]:
    """One Llama/Qwen2 decoder layer in Hugging Face names; `qkv_in` is the attention input width, `out_std`
    the scale of what the layer adds to the residual stream (o_proj, down_proj)."""
    head_dim, qkv_in = hidden // heads, qkv_in or hidden
    t = {f"{prefix}.input_layernorm.weight": torch.ones(hidden),
         f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
         f"{prefix}.self_attn.q_proj.weight": _random(gen, heads * head_dim, qkv_in),
         f"{prefix}.self_attn.k_proj.weight": _random(gen, kv_heads * head_dim, qkv_in),
         f"{prefix}.self_attn.v_proj.weight": _random(gen, kv_heads * head_dim, qkv_in),
         f"{prefix}.self_attn.o_proj.weight": _random(gen, hidden, heads * head_dim, std=out_std),
         f"{prefix}.mlp.gate_proj.weight": _random(gen, inter, hidden),
         f"{prefix}.mlp.up_proj.weight": _random(gen, inter, hidden),
         f"{prefix}.mlp.down_proj.weight": _random(gen, hidden, inter, std=out_std)}
    if qkv_bias:
        for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            t[f"{prefix}.self_attn.{p}_proj.bias"] = _random(gen, n * head_dim)
    return t


def _near_bigram_target(gen, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
                        qkv_bias: bool) -> dict[str, torch.Tensor]:
    t = {"model.embed_tokens.weight": _random(gen, vocab, hidden, std=1.0), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": _random(gen, vocab, hidden)}
    for i in range(layers):
        t.update(_decoder_layer(gen, f"model.layers.{i}", hidden, heads, kv_heads, inter, qkv_bias=qkv_bias,
                                out_std=MIX_STD))
    return t


def bigram(embed: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """(vocab,) next token of a target without attention and MLPs: argmax of lm_head . rmsnorm(embedding)."""
    e = embed.float()
    return ((e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + RMS_EPS)) @ lm_head.float().T).argmax(-1)


def _tokenizer_config(tokenizer_from: Path) -> dict:
    return json.loads((Path(tokenizer_from) / "config.json").read_text())


def _target_config(arch: str, model_type: str, tok: dict, hidden: int, layers: int, heads: int, kv_heads: int,
                   inter: int) -> dict:
    return {"architectures": [arch], "model_type": model_type, "vocab_size": tok["vocab_size"],
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "max_position_embeddings": tok["max_position_embeddings"], "rms_norm_eps": RMS_EPS,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": tok["bos_token_id"], "eos_token_id": tok["eos_token_id"],
            "pad_token_id": tok["pad_token_id"], "torch_dtype": "bfloat16"}


def write_llama_target(out_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 4, heads: int = 4,
                       kv_heads: int = 2, intermediate_size: int = 128, tokenizer_from: Path = BUNDLED_MODEL,
                       seed: int = 0) -> Path:
    """A near-bigram Llama target with the tokenizer of `tokenizer_from`. The directory's name is the served
    model name (tree sets are matched on it)."""
    tok = _tokenizer_config(tokenizer_from)
    gen = torch.Generator().manual_seed(seed)
    tensors = _near_bigram_target(gen, tok["vocab_size"], hidden_size, num_layers, heads, kv_heads,
                                  intermediate_size, qkv_bias=False)
    config = _target_config(LLAMA_ARCH, "llama", tok, hidden_size, num_layers, heads, kv_heads, intermediate_size)
    return _save(Path(out_dir), config, tensors, tokenizer_from)


def write_eagle3_draft(out_dir: str | Path, target: str | Path, *, draft_vocab_size: int = 2048,
                       aux_layer_ids: tuple[int, int, int] = (0, 1, 2), seed: int = 1) -> Path:
    """A one-layer EAGLE-3 draft for `target` (a Llama checkpoint from write_llama_target): the target's hidden
    size (it shares the target's embedding), `fc` from the three captured layers' hidden states, and an
    lm_head over `draft_vocab_size` target tokens (`d2t[i]` = target id of draft token i minus i; `t2d`
    marks them): every token bigram() can produce, then random others."""
    from safetensors.torch import load_file

    target = Path(target)
    tcfg = json.loads((target / "config.json").read_text())
    hidden, vocab, heads = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_attention_heads"]
    if max(aux_layer_ids) + 1 >= tcfg["num_hidden_layers"]:
        raise ValueError(f"aux_layer_ids {aux_layer_ids}: SGLang captures the input of layer id + 1, and the "
                         f"target has {tcfg['num_hidden_layers']} layers")
    weights = load_file(str(target / "model.safetensors"))
    produced = bigram(weights["model.embed_tokens.weight"], weights["lm_head.weight"]).unique()
    if not len(produced) <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must lie in [{len(produced)}, {vocab}], got {draft_vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[produced] = False
    others = rest.nonzero().flatten()
    fill = others[torch.randperm(len(others), generator=gen)[: draft_vocab_size - len(produced)]]
    hot = torch.cat([produced, fill]).sort().values                # target ids of the draft vocabulary
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    eye, zero = torch.eye(hidden), torch.zeros(hidden, hidden)
    layer = _decoder_layer(gen, "midlayer", hidden, heads, heads, 2 * hidden, qkv_in=2 * hidden)
    # attention input is [input_layernorm(token embedding) | hidden_norm(carried state)]: read the token only
    layer["midlayer.self_attn.q_proj.weight"] = torch.cat([DRAFT_ATTN_SHARPNESS * eye, zero], 1)
    layer["midlayer.self_attn.k_proj.weight"] = torch.cat([eye, zero], 1)
    layer["midlayer.self_attn.v_proj.weight"] = torch.cat([eye, zero], 1)
    layer["midlayer.self_attn.o_proj.weight"] = DRAFT_GAIN * eye
    tensors = {"fc.weight": _random(gen, hidden, len(aux_layer_ids) * hidden), "norm.weight": torch.ones(hidden),
               "lm_head.weight": weights["lm_head.weight"].float()[hot], "d2t": hot - torch.arange(len(hot)),
               "t2d": t2d, "midlayer.hidden_norm.weight": torch.ones(hidden), **layer}
    config = {k: tcfg[k] for k in ("model_type", "vocab_size", "hidden_size", "num_attention_heads",
                                   "max_position_embeddings", "rms_norm_eps", "rope_theta", "hidden_act",
                                   "bos_token_id", "eos_token_id", "pad_token_id")}
    # norm_output: the state carried to the next draft step is normed, so DRAFT_GAIN keeps the token dominant
    config.update(architectures=[EAGLE3_ARCH], num_key_value_heads=heads, intermediate_size=2 * hidden,
                  num_hidden_layers=1, draft_vocab_size=draft_vocab_size, tie_word_embeddings=False,
                  norm_output=True, torch_dtype="bfloat16",
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                                "use_aux_hidden_state": True})
    return _save(Path(out_dir), config, tensors, None)


def write_mimo_with_mtp(out_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 2, heads: int = 4,
                        kv_heads: int = 2, intermediate_size: int = 128, tokenizer_from: Path = BUNDLED_MODEL,
                        seed: int = 0) -> Path:
    """A near-bigram MiMo target with one MTP layer (`model.mtp_layers.0.*`: token and hidden norms,
    `input_proj` from their concatenation, a Qwen2 decoder layer, a final norm) and the tokenizer of
    `tokenizer_from`. The directory's name is the served model name (tree sets are matched on it)."""
    tok = _tokenizer_config(tokenizer_from)
    gen = torch.Generator().manual_seed(seed)
    h = hidden_size
    tensors = _near_bigram_target(gen, tok["vocab_size"], h, num_layers, heads, kv_heads, intermediate_size,
                                  qkv_bias=True)
    mtp = "model.mtp_layers.0"
    tensors.update({f"{mtp}.token_layernorm.weight": torch.ones(h), f"{mtp}.hidden_layernorm.weight": torch.ones(h),
                    # input is [hidden_layernorm(target state) | token_layernorm(token embedding)]
                    f"{mtp}.input_proj.weight": torch.cat([torch.zeros(h, h), torch.eye(h)], 1),
                    f"{mtp}.final_layernorm.weight": torch.ones(h),
                    **_decoder_layer(gen, mtp, h, heads, kv_heads, intermediate_size, qkv_bias=True)})
    config = {**_target_config(MIMO_ARCH, "qwen2", tok, h, num_layers, heads, kv_heads, intermediate_size),
              "use_sliding_window": False, "num_nextn_predict_layers": 1}
    return _save(Path(out_dir), config, tensors, tokenizer_from)
