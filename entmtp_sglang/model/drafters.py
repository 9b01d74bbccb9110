"""The three multi-token-prediction drafters, all reading the frozen target's final-normed hidden state.

Notation: the target has committed tokens x_0 .. x_{n-1}; its hidden state there is f_{n-1}, from which
it chose the next token x_n (the tree's root, already known). A drafter proposes x_{n+1}, x_{n+2}, ...

* Medusa: K independent heads; head k maps f_{n-1} to a distribution over x_{n+k}.
* Hydra: head k also sees the tokens on the path, x_n .. x_{n+k-1}, through a recurrent state.
* EAGLE: one Llama decoder layer over (embedding of token, feature of the previous position), in
  SGLang's `LlamaForCausalLMEagle` layout; it has its own KV cache over the committed context.

Drafters for a large-vocabulary target (SmolLM2's 49,152 tokens) store no embedding or output layer of
their own: they share the target's (`share_target`), restricted to a draft vocabulary of the most frequent
tokens (FR-Spec, EAGLE-3's draft-to-target map), because the full output layer dominates a drafter step on
a CPU. Their logits still cover the whole vocabulary, with -inf outside the draft vocabulary, so drafting,
grammar masks and signals need not know.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear, linear
from .llama import DecoderLayer, KVCache, LlamaShape, RMSNorm, Rotary


class DrafterMismatch(ValueError):
    """A drafter's config that does not fit the target it is loaded with."""


class DraftVocabHead(nn.Module):
    """The target's output layer restricted to `draft_ids` (Vd,) target token ids.

    logits[..., draft_ids[i]] = x . W_target[draft_ids[i]]; every other token gets -inf."""

    def __init__(self, vocab_size: int, draft_ids: torch.Tensor):
        super().__init__()
        if draft_ids.dim() != 1 or int(draft_ids.max()) >= vocab_size or int(draft_ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids must be a 1-D list within [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.register_buffer("draft_ids", draft_ids.long(), persistent=False)
        self.weight: torch.Tensor | None = None  # (Vd, d), the target's rows; set by attach

    def attach(self, target_head_weight: torch.Tensor) -> None:
        self.weight = target_head_weight.detach()[self.draft_ids].contiguous()

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary only: (..., Vd)."""
        if self.weight is None:
            raise RuntimeError("the drafter's output layer is shared with the target: call share_target first")
        return linear(x, self.weight.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.draft_logits(x)
        out = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, small)


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K parallel heads, each a residual block and its own output layer."""

    kind = "medusa"

    def __init__(self, hidden: int, vocab: int, num_heads: int, draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(ResBlock(hidden) for _ in range(num_heads))
        if draft_ids is None:  # own output layers (the bundled model's drafters)
            self.lm_heads = nn.ModuleList(Linear(hidden, vocab, bias=False) for _ in range(num_heads))
            self.head = None
        else:
            self.head = DraftVocabHead(vocab, draft_ids)

    def share_target(self, target) -> None:
        if self.head is not None:
            self.head.attach(target.lm_head_weight)

    @classmethod
    def from_config(cls, cfg: dict, target_shape: LlamaShape, draft_ids: torch.Tensor | None = None) -> "MedusaHeads":
        return cls(target_shape.hidden_size, target_shape.vocab_size, cfg["num_heads"], draft_ids)

    @property
    def max_depth(self) -> int:
        return self.num_heads

    def head_logits(self, feature: torch.Tensor, depth: int) -> torch.Tensor:
        """feature (..., d) = f_{n-1}; returns logits (..., V) over x_{n+depth}, depth in 1..K."""
        h = self.blocks[depth - 1](feature)
        return self.head(h) if self.head is not None else self.lm_heads[depth - 1](h)


class HydraHead(nn.Module):
    """Sequentially dependent heads: z_0 = f_{n-1}; z_k = z_{k-1} + MLP_k([z_{k-1}, E(x_{n+k-1})])."""

    kind = "hydra"

    def __init__(self, hidden: int, vocab: int, num_heads: int, eps: float = 1e-5,
                 draft_ids: torch.Tensor | None = None, mlp_width: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        width = mlp_width or 2 * hidden
        self.mlps = nn.ModuleList(
            nn.Sequential(Linear(2 * hidden, width), nn.SiLU(), Linear(width, hidden))
            for _ in range(num_heads)
        )
        for mlp in self.mlps:
            nn.init.zeros_(mlp[2].weight)
            nn.init.zeros_(mlp[2].bias)
        self.norm = RMSNorm(hidden, eps)
        if draft_ids is None:  # own embedding and output layer (the bundled model's drafter)
            self.embed = nn.Embedding(vocab, hidden)
            self.lm_head = Linear(hidden, vocab, bias=False)
        else:  # the target's, shared (share_target)
            self.embed = None
            self.lm_head = DraftVocabHead(vocab, draft_ids)
        self._embed_weight: torch.Tensor | None = None

    def share_target(self, target) -> None:
        if self.embed is None:
            self._embed_weight = target.model.embed_tokens.weight.detach()
            self.lm_head.attach(target.lm_head_weight)

    @classmethod
    def from_config(cls, cfg: dict, target_shape: LlamaShape, draft_ids: torch.Tensor | None = None) -> "HydraHead":
        return cls(target_shape.hidden_size, target_shape.vocab_size, cfg["num_heads"], target_shape.rms_norm_eps,
                   draft_ids, cfg.get("mlp_width"))

    def embed_tokens(self, token: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return self.embed(token)
        if self._embed_weight is None:
            raise RuntimeError("the drafter's embedding is shared with the target: call share_target first")
        return F.embedding(token, self._embed_weight)

    @property
    def max_depth(self) -> int:
        return self.num_heads

    def step(self, state: torch.Tensor, token: torch.Tensor, depth: int):
        """Advance from depth-1 to depth. state (..., d), token (...) = x_{n+depth-1}.

        Returns (new_state, logits over x_{n+depth})."""
        z = state + self.mlps[depth - 1](torch.cat((state, self.embed_tokens(token).to(state.dtype)), dim=-1))
        return z, self.lm_head(self.norm(z))


class EagleDraft(nn.Module):
    """One-layer EAGLE draft model; weight names match SGLang's `LlamaForCausalLMEagle` checkpoints.

    out_p = Layer(fc([E(x_p), f_{p-1}])) approximates the target feature f_p; logits = lm_head(out_p)
    with the target's LM head (no final norm), as SGLang computes them.
    """

    kind = "eagle"

    def __init__(self, shape: LlamaShape, draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        # None: logits with the target's full output layer; else the draft vocabulary (SGLang's token map)
        self.head = DraftVocabHead(shape.vocab_size, draft_ids) if draft_ids is not None else None
        self.shares_embedding = draft_ids is not None
        self.fc = Linear(2 * shape.hidden_size, shape.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(shape, input_norm=False)])
        self.rotary = Rotary(shape.head_dim, shape.rope_theta, shape.max_position_embeddings)

    @classmethod
    def from_config(cls, cfg: dict, target_shape: LlamaShape, draft_ids: torch.Tensor | None = None) -> "EagleDraft":
        """cfg: the checkpoint's own Llama config (SGLang's layout), which must agree with the target's
        vocabulary and width."""
        shape = LlamaShape.from_config_dict(cfg)
        check_fits(shape, target_shape)
        return cls(shape, draft_ids)

    @property
    def max_depth(self) -> int:
        return 64  # autoregressive: limited only by the tree

    def target_shared(self, state: dict) -> tuple[str, ...]:
        """The weights a checkpoint without them takes from the target (`share_target`): the embedding, which
        SGLang replaces with the target's anyway (`set_embed_and_head`), so no checkpoint needs to store it."""
        self.shares_embedding = self.shares_embedding or "embed_tokens.weight" not in state
        return ("embed_tokens.weight",) if self.shares_embedding else ()

    def share_target(self, target) -> None:
        if self.shares_embedding:  # checkpoints without embed_tokens, as SGLang shares the target's too
            self.embed_tokens.weight.data = target.model.embed_tokens.weight.detach().to(
                self.embed_tokens.weight.dtype)
        if self.head is not None:
            self.head.attach(target.lm_head_weight)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        s = self.shape
        p = self.fc.weight
        return KVCache(1, batch, s.num_key_value_heads, capacity, s.head_dim, p.dtype, p.device)

    def forward(self, tokens, features, positions, mask=None, cache=None, start=None):
        """tokens, positions (B, T); features (B, T, d) = f_{p-1} for each token x_p. Returns out (B, T, d)."""
        x = self.fc(torch.cat((self.embed_tokens(tokens), features), dim=-1))
        return self.layers[0](x, positions, self.rotary, mask, cache, 0, start)


def check_fits(shape: LlamaShape, target_shape: LlamaShape) -> None:
    """A drafter with a Llama config of its own must share the target's vocabulary and width."""
    bad = [f"{k} {getattr(shape, k)} (the target's {getattr(target_shape, k)})"
           for k in ("vocab_size", "hidden_size") if getattr(shape, k) != getattr(target_shape, k)]
    if bad:
        raise DrafterMismatch(f"its {' and '.join(bad)}")


SHARED_WEIGHTS = ("embed_tokens.weight", "embed.weight")  # never stored by drafters that share the target's


def build_drafter(kind: str, shape: LlamaShape, num_heads: int = 5, draft_ids: torch.Tensor | None = None,
                  mlp_width: int | None = None) -> nn.Module:
    if kind == "medusa":
        return MedusaHeads(shape.hidden_size, shape.vocab_size, num_heads, draft_ids)
    if kind == "hydra":
        return HydraHead(shape.hidden_size, shape.vocab_size, num_heads, shape.rms_norm_eps, draft_ids, mlp_width)
    if kind == "eagle":
        return EagleDraft(shape, draft_ids)
    raise ValueError(f"build_drafter makes medusa, hydra and eagle drafters for training, not {kind!r}")
