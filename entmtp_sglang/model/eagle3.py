"""EAGLE-3 drafter: one decoder layer over the target's fused low, mid and high features, with a draft vocabulary.

Weight names and arithmetic follow SGLang's `LlamaForCausalLMEagle3` (`srt/models/llama_eagle3.py`), so an
exported checkpoint (`export`) serves as `--speculative-algorithm EAGLE3` (or as ENTMTP's draft model):

    g_p   = fc([a_low, a_mid, a_high])      (3d -> d) at committed positions, where a_l is the residual stream
                                            entering target layer l at position p-1 (`target_layers`);
          = out_{p-1}                       inside a draft tree (the drafter's own output, width d: no fc)
    h     = g_p + Attn([input_layernorm(E(x_p)), hidden_norm(g_p)])     the attention reads 2d
    out_p = h + MLP(post_attention_layernorm(h))                         fed to the next draft level
    logits over x_{p+1} = lm_head(norm(out_p))  over the draft vocabulary; target id = draft id + d2t[draft id]

The embedding is the target's (never stored, as SGLang shares it). `lm_head` holds the target's output rows of
the draft vocabulary when the checkpoint has none (a shipped drafter trained with the head frozen stores no
head; `export(..., with_head=True)` writes it for SGLang). Checkpoint weights:

    fc.weight (d, 3d); midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight;
    midlayer.self_attn.{q,k,v}_proj.weight (out, 2d), o_proj; midlayer.mlp.{gate,up,down}_proj.weight;
    norm.weight; [lm_head.weight (Vd, d)]; d2t int64 (Vd,); t2d bool (V,)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .linear import Linear, linear
from .llama import MLP, Attention, KVCache, LlamaShape, RMSNorm, Rotary

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_target_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """The target layers whose input EAGLE-3 fuses: SGLang's default capture for Llama, [2, L//2, L-3], or
    [1, L//2, L-1] where those are not distinct (`training.fixed_data.eagle3_layers`, the same rule)."""
    low, mid, high = 2, num_hidden_layers // 2, num_hidden_layers - 3
    return (low, mid, high) if low < mid < high else (1, mid, num_hidden_layers - 1)


def target_layers_of(cfg: dict, target_num_layers: int) -> tuple[int, ...]:
    """SGLang's reading of a draft config: `eagle_config.eagle_aux_hidden_state_layer_ids` are layer outputs, so the
    captured inputs are those ids + 1; without them the default."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) + 1 for i in ids) if ids else default_target_layers(target_num_layers)


class FusedInputAttention(Attention):
    """Attention whose q, k, v read [embedding, feature] (2d); the output is d wide."""

    def __init__(self, shape: LlamaShape):
        super().__init__(shape)
        hd, d = shape.head_dim, shape.hidden_size
        self.q_proj = Linear(2 * d, self.n_heads * hd, bias=False)
        self.k_proj = Linear(2 * d, self.n_kv * hd, bias=False)
        self.v_proj = Linear(2 * d, self.n_kv * hd, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = FusedInputAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)

    def attention_input(self, embeds: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(g)), dim=-1)

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = g + attn
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, embeds, g, positions, rotary, mask, cache, start):
        attn = self.self_attn(self.attention_input(embeds, g), positions, rotary, mask, cache, 0, start)
        return self.finish(g, attn)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft model; `forward` returns out_p (pre-norm, what the next level reads); `logits` the
    draft-vocabulary logits scattered into the target's vocabulary (-inf elsewhere)."""

    kind = "eagle3"

    def __init__(self, shape: LlamaShape, draft_ids: torch.Tensor, target_layers: tuple[int, ...],
                 target_hidden_size: int | None = None):
        super().__init__()
        d = shape.hidden_size
        if draft_ids.dim() != 1 or int(draft_ids.max()) >= shape.vocab_size or int(draft_ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids must be a 1-D list within [0, {shape.vocab_size})")
        self.shape = shape
        self.target_layers = tuple(target_layers)
        self.target_hidden_size = target_hidden_size or d
        self.embed_tokens = nn.Embedding(shape.vocab_size, d)
        self.fc = Linear(len(self.target_layers) * self.target_hidden_size, d, bias=False)
        self.midlayer = Eagle3Layer(shape)
        self.norm = RMSNorm(d, shape.rms_norm_eps)
        self.lm_head = Linear(d, len(draft_ids), bias=False)
        ids = draft_ids.long()
        t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("d2t", ids - torch.arange(len(ids)))  # SGLang's layout: target = draft + d2t
        self.register_buffer("t2d", t2d)
        self.rotary = Rotary(shape.head_dim, shape.rope_theta, shape.max_position_embeddings)
        self._head_from_target = False

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict, target_shape: LlamaShape, draft_ids: torch.Tensor | None = None) -> "Eagle3Draft":
        from .drafters import check_fits

        shape = LlamaShape.from_config_dict(cfg)
        check_fits(shape, target_shape)
        vd = int(cfg.get("draft_vocab_size") or shape.vocab_size)
        ids = draft_ids if draft_ids is not None else torch.arange(vd)  # the real ids arrive with d2t
        return cls(shape, ids, target_layers_of(cfg, target_shape.num_hidden_layers),
                   cfg.get("target_hidden_size", target_shape.hidden_size))

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    @property
    def max_depth(self) -> int:
        return 64  # autoregressive: limited only by the tree

    def target_shared(self, state: dict) -> tuple[str, ...]:
        """The weights a checkpoint without them takes from the target (`share_target`)."""
        self._head_from_target = "lm_head.weight" not in state
        return ("embed_tokens.weight", "lm_head.weight") if self._head_from_target else ("embed_tokens.weight",)

    def share_target(self, target) -> None:
        self.embed_tokens.weight.data = target.model.embed_tokens.weight.detach().to(self.fc.weight.dtype)
        if self._head_from_target:
            self.lm_head.weight.data = target.lm_head_weight.detach()[self.draft_ids].to(self.fc.weight.dtype)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s, p = self.shape, self.fc.weight
        return KVCache(1, batch, s.num_key_value_heads, capacity, s.head_dim, p.dtype, p.device)

    # -- compute -----------------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g: the target's concatenated features through fc; the drafter's own output (width d) as it is."""
        return self.fc(features) if features.shape[-1] != self.shape.hidden_size else features

    def forward(self, tokens, features, positions, mask=None, cache=None, start=None):
        """tokens, positions (B, T); features (B, T, 3d) target features of p-1 or (B, T, d) drafter outputs.
        Returns out (B, T, d)."""
        embeds = self.embed_tokens(tokens).to(self.fc.weight.dtype)
        return self.midlayer(embeds, self.fuse(features), positions, self.rotary, mask, cache, start)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """(..., Vd) logits over the draft vocabulary."""
        return linear(self.norm(out), self.lm_head.weight)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        small = self.draft_logits(out)
        full = small.new_full((*small.shape[:-1], self.shape.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_ids, small)


# -- SGLang's checkpoint layout ---------------------------------------------------------------------------------

def sglang_config(draft: Eagle3Draft, target_config: dict, extra: dict | None = None) -> dict:
    """config.json for SGLang's `LlamaForCausalLMEagle3`, from the target's config."""
    s = draft.shape
    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "rope_theta", "rope_scaling",
            "head_dim", "hidden_act", "mlp_bias", "attention_bias")
    cfg = {k: target_config[k] for k in keep if k in target_config}
    cfg.update({
        "architectures": [ARCHITECTURE], "model_type": "llama", "dtype": "bfloat16",
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
        "max_position_embeddings": s.max_position_embeddings, "rms_norm_eps": s.rms_norm_eps,
        "vocab_size": s.vocab_size, "draft_vocab_size": len(draft.d2t), "tie_word_embeddings": False,
        "target_hidden_size": draft.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in draft.target_layers],
                         "use_aux_hidden_state": True},
    })
    cfg.setdefault("rope_theta", s.rope_theta)
    cfg.update(extra or {})
    return cfg


def checkpoint_state(draft: Eagle3Draft, with_head: bool, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The weights as SGLang names them (bf16), the embedding left out; the head only `with_head`."""
    out = {}
    for k, v in draft.state_dict().items():
        if k.startswith("embed_tokens") or k.startswith("rotary") or (k.startswith("lm_head") and not with_head):
            continue
        out[k] = v.detach().contiguous() if k in ("d2t", "t2d") else v.detach().to(dtype).contiguous()
    return out


def export(draft: Eagle3Draft, out_dir: Path, target_config: dict, with_head: bool = True,
           extra_config: dict | None = None) -> Path:
    """Write `out_dir/config.json` and `model.safetensors` in SGLang's EAGLE-3 layout."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_state(draft, with_head), str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(sglang_config(draft, target_config, extra_config), indent=1))
    return out_dir
