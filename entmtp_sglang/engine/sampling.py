"""Sampling parameters and the one logits -> probabilities transform shared by plain and speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float probabilities after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it is kept)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def entropy_nats(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) entropy of softmax(logits) in nats (masked -inf entries allowed).

    Runs the fused Triton kernel on CUDA and its torch reference elsewhere (`entmtp_sglang.kernels`)."""
    from ..kernels import softmax_entropy

    if logits.dim() == 1:
        return softmax_entropy(logits.float().unsqueeze(0))[0]
    flat = logits.float().reshape(-1, logits.shape[-1])
    return softmax_entropy(flat).reshape(logits.shape[:-1])


def top_margin(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) p(top-1) - p(top-2) of softmax(logits). Masked (-inf) entries count as
    probability 0; a row with a single allowed token has margin 1."""
    x = logits.float()
    lse = torch.logsumexp(x, -1, keepdim=True)
    top = torch.exp(x.topk(min(2, x.shape[-1]), -1).values - lse)  # the two largest probabilities
    second = top[..., 1] if top.shape[-1] > 1 else torch.zeros_like(top[..., 0])
    return (top[..., 0] - second).nan_to_num(0.0)


def top_probs(logits: torch.Tensor, k: int = 6) -> torch.Tensor:
    """(..., V) logits -> (..., k) the k largest probabilities of softmax(logits), descending (masked
    entries count as 0; a row with nothing allowed gives zeros)."""
    x = logits.float()
    lse = torch.logsumexp(x, -1, keepdim=True)
    return torch.exp(x.topk(min(k, x.shape[-1]), -1).values - lse).nan_to_num(0.0)
