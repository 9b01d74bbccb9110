"""A plain-torch Llama decoder that loads Hugging Face `LlamaForCausalLM` checkpoints unchanged.

It is the target model of the reference engine. Its weight names, RMSNorm and rotary embedding follow
`transformers`' Llama exactly, so the same safetensors file serves this module, `transformers` and SGLang.
Attention takes an explicit boolean mask, so one forward pass can verify a whole token tree: through
FlashInfer's custom-mask prefill on CUDA (float16/bfloat16, when flashinfer imports), through torch SDPA
with the mask everywhere else (`entmtp_sglang.kernels.tree_attention`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import rowwise_ops
from ..kernels.tree_attention import ATTENTION_BACKENDS, tree_attention
from .linear import Linear, PackedWeight, applies, linear, packed_linear


@dataclass(frozen=True)
class LlamaShape:
    """The fields of a Hugging Face `LlamaConfig` that this module reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config_dict(cls, cfg: dict) -> "LlamaShape":
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            max_position_embeddings=cfg["max_position_embeddings"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "LlamaShape":
        return cls.from_config_dict(json.loads(Path(path).read_text()))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rowwise_ops.takes(x) and self.weight.dtype is torch.float32:   # one pass per row (kernels/rowwise_ops)
            return rowwise_ops.rmsnorm(x.contiguous(), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding, `rotate_half` layout as in `transformers`' Llama."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        # the row-wise op's layout: each position's head_dim / 2 cosines, then its sines
        half = head_dim // 2
        self.register_buffer("cos_sin", torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=-1), persistent=False)

    def rotate_rows(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, head_dim: int):
        """q, k: (B, T, heads x head_dim), positions (B, T): both rotated by the row-wise op (float32 CPU), the
        same element-wise arithmetic as `forward`."""
        b, t = positions.shape
        qr, kr = rowwise_ops.rope(positions.reshape(-1).long().contiguous(), q.reshape(b * t, -1).contiguous(),
                                  k.reshape(b * t, -1).contiguous(), self.cos_sin, head_dim, True)
        return qr.view(q.shape), kr.view(k.shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (B, nh, T, hd); positions: (B, T)
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class KVCache:
    """Padded per-layer key/value storage for a batch: (B, n_kv_heads, capacity, head_dim)."""

    def __init__(self, num_layers: int, batch: int, n_kv: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (batch, n_kv, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity

    def write(self, layer: int, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, n_kv, T, hd) at slots start[b] .. start[b] + T - 1 of each row b,
        or, if start is (B, T), at the slots it lists."""
        t = k.shape[2]
        if t == 0:
            return
        batch = k.shape[0]
        if start.dim() == 2:
            slots = start
        else:
            slots = start.view(batch, 1) + torch.arange(t, device=k.device).view(1, t)  # (B, T)
        idx = slots.view(batch, 1, t, 1).expand(batch, k.shape[1], t, k.shape[3])
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)

    def keep(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Compaction: for each i, copy slot src[i] of row rows[i] to slot dst[i] (all layers).
        The indices may live on another device than the cache (the engine keeps them on the CPU)."""
        if rows.numel() == 0:
            return
        dev = self.k[0].device
        rows, src, dst = rows.to(dev), src.to(dev), dst.to(dev)
        for cache in (self.k, self.v):
            for layer in cache:
                layer[rows, :, dst] = layer[rows, :, src]


class Attention(nn.Module):
    backend = "auto"  # tree attention backend: "auto" | "torch" | "flashinfer" (set_attention_backend)

    def __init__(self, shape: LlamaShape):
        super().__init__()
        hd = shape.head_dim
        self.n_heads = shape.num_attention_heads
        self.n_kv = shape.num_key_value_heads
        self.head_dim = hd
        self.q_proj = Linear(shape.hidden_size, self.n_heads * hd, bias=False)
        self.k_proj = Linear(shape.hidden_size, self.n_kv * hd, bias=False)
        self.v_proj = Linear(shape.hidden_size, self.n_kv * hd, bias=False)
        self.o_proj = Linear(self.n_heads * hd, shape.hidden_size, bias=False)
        self._qkv = PackedWeight()

    def forward(self, x, positions, rotary, mask, cache: KVCache | None, layer: int, start):
        b, t, _ = x.shape
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        if applies(x, *weights):  # one oneDNN call for the three projections
            q, k, v = packed_linear(x, self._qkv.get(weights)).split([w.shape[0] for w in weights], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        rows = rowwise_ops.takes(q) and rotary.cos_sin.dtype is torch.float32
        if rows:
            q, k = rotary.rotate_rows(q, k, positions, self.head_dim)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if not rows:
            q, k = rotary(q, positions), rotary(k, positions)
        if cache is not None:
            cache.write(layer, start, k, v)
            k, v = cache.k[layer], cache.v[layer]  # (B, n_kv, C, hd); the mask covers slots [0, S)
        if mask is None:  # causal self-attention over the new tokens alone (no cache)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            y = tree_attention(q, k, v, mask, backend=self.backend)  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self._gate_up = PackedWeight()

    def forward(self, x):
        weights = (self.gate_proj.weight, self.up_proj.weight)
        if applies(x, *weights):  # one call for both
            gate_up = packed_linear(x, self._gate_up.get(weights))
            if rowwise_ops.takes(gate_up):
                return self.down_proj(rowwise_ops.silu_and_mul(gate_up.contiguous()))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, input_norm: bool = True):
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        # EAGLE's first draft layer has no input norm (SGLang's llama_eagle does the same).
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps) if input_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x, positions, rotary, mask, cache, layer, start):
        h = x + self.self_attn(self.input_layernorm(x), positions, rotary, mask, cache, layer, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBody(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Target model. `forward` returns the final-normed hidden states; `logits` applies the LM head."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.model = LlamaBody(shape)
        self.rotary = Rotary(shape.head_dim, shape.rope_theta, shape.max_position_embeddings)
        if not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.shape.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def new_cache(self, batch: int, capacity: int, dtype=None, device=None) -> KVCache:
        s = self.shape
        p = self.model.embed_tokens.weight
        return KVCache(s.num_hidden_layers, batch, s.num_key_value_heads, capacity, s.head_dim,
                       dtype or p.dtype, device or p.device)

    def forward(self, input_ids, positions=None, mask=None, cache=None, start=None, capture=None):
        """input_ids, positions: (B, T). mask: bool (B, 1, T, S) over cache slots, or None for causal.

        With a cache, the new keys/values go to slots start[b] .. start[b]+T-1 and `mask` must cover
        slots [0, S). Returns hidden states (B, T, d) after the final norm; with `capture` (layer indices) also
        the residual stream entering each of those layers, concatenated in that order: (B, T, len(capture) * d)
        (SGLang's `layers_to_capture`, what an EAGLE-3 drafter fuses).
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if capture is not None and i in capture:
                captured[i] = x
            x = layer(x, positions, self.rotary, mask, cache, i, start)
        if capture is None:
            return self.model.norm(x)
        missing = [i for i in capture if i not in captured]
        if missing:
            raise ValueError(f"capture layers {missing} are not among the target's {len(self.model.layers)} layers")
        return self.model.norm(x), torch.cat([captured[i] for i in capture], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head_weight)

    def set_attention_backend(self, backend: str) -> None:
        """Tree attention backend of every layer: "auto" (FlashInfer for CUDA float16/bfloat16 when it
        imports, else torch SDPA), "torch" or "flashinfer"."""
        set_attention_backend(self, backend)


def set_attention_backend(module: nn.Module, backend: str) -> None:
    """Set the tree attention backend of every `Attention` in `module` (a target or an EAGLE drafter)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")
    for m in module.modules():
        if isinstance(m, Attention):
            m.backend = backend


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
    # scale residual projections by depth (GPT-2 style)
    for name, p in module.named_parameters():
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            n_layers = max(1, sum(1 for _ in module.modules() if isinstance(_, DecoderLayer)))
            nn.init.normal_(p, std=std / math.sqrt(2 * n_layers))
