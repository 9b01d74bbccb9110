"""The three multi-token-prediction drafters, all reading the frozen target's final-normed hidden state.

Notation: the target has committed tokens x_0 .. x_{n-1}; its hidden state there is f_{n-1}, from which
it chose the next token x_n (the tree's root, already known). A drafter proposes x_{n+1}, x_{n+2}, ...

* Medusa: K independent heads; head k maps f_{n-1} to a distribution over x_{n+k}.
* Hydra: head k also sees the tokens on the path, x_n .. x_{n+k-1}, through a recurrent state.
* EAGLE: one Llama decoder layer over (embedding of token, feature of the previous position), in
  SGLang's `LlamaForCausalLMEagle` layout; it has its own KV cache over the committed context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .llama import DecoderLayer, KVCache, LlamaShape, RMSNorm, Rotary


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K parallel heads, each a residual block and its own output layer."""

    kind = "medusa"

    def __init__(self, hidden: int, vocab: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(ResBlock(hidden) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))

    @property
    def max_depth(self) -> int:
        return self.num_heads

    def head_logits(self, feature: torch.Tensor, depth: int) -> torch.Tensor:
        """feature (..., d) = f_{n-1}; returns logits (..., V) over x_{n+depth}, depth in 1..K."""
        return self.lm_heads[depth - 1](self.blocks[depth - 1](feature))


class HydraHead(nn.Module):
    """Sequentially dependent heads: z_0 = f_{n-1}; z_k = z_{k-1} + MLP_k([z_{k-1}, E(x_{n+k-1})])."""

    kind = "hydra"

    def __init__(self, hidden: int, vocab: int, num_heads: int, eps: float = 1e-5):
        super().__init__()
        self.num_heads = num_heads
        self.embed = nn.Embedding(vocab, hidden)
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
            for _ in range(num_heads)
        )
        for mlp in self.mlps:
            nn.init.zeros_(mlp[2].weight)
            nn.init.zeros_(mlp[2].bias)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    @property
    def max_depth(self) -> int:
        return self.num_heads

    def step(self, state: torch.Tensor, token: torch.Tensor, depth: int):
        """Advance from depth-1 to depth. state (..., d), token (...) = x_{n+depth-1}.

        Returns (new_state, logits over x_{n+depth})."""
        z = state + self.mlps[depth - 1](torch.cat((state, self.embed(token)), dim=-1))
        return z, self.lm_head(self.norm(z))


class EagleDraft(nn.Module):
    """One-layer EAGLE draft model; weight names match SGLang's `LlamaForCausalLMEagle` checkpoints.

    out_p = Layer(fc([E(x_p), f_{p-1}])) approximates the target feature f_p; logits = lm_head(out_p)
    with the target's LM head (no final norm), as SGLang computes them.
    """

    kind = "eagle"

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.fc = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(shape, input_norm=False)])
        self.rotary = Rotary(shape.head_dim, shape.rope_theta, shape.max_position_embeddings)

    @property
    def max_depth(self) -> int:
        return 64  # autoregressive: limited only by the tree

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s = self.shape
        p = self.fc.weight
        return KVCache(1, batch, s.num_key_value_heads, capacity, s.head_dim, p.dtype, p.device)

    def forward(self, tokens, features, positions, mask=None, cache=None, start=None):
        """tokens, positions (B, T); features (B, T, d) = f_{p-1} for each token x_p. Returns out (B, T, d)."""
        x = self.fc(torch.cat((self.embed_tokens(tokens), features), dim=-1))
        return self.layers[0](x, positions, self.rotary, mask, cache, 0, start)


def build_drafter(kind: str, shape: LlamaShape, num_heads: int = 5) -> nn.Module:
    if kind == "medusa":
        return MedusaHeads(shape.hidden_size, shape.vocab_size, num_heads)
    if kind == "hydra":
        return HydraHead(shape.hidden_size, shape.vocab_size, num_heads, shape.rms_norm_eps)
    if kind == "eagle":
        return EagleDraft(shape)
    raise ValueError(f"unknown drafter {kind!r}; choose one of medusa, hydra, eagle")
