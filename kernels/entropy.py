"""Softmax entropy per row: dispatcher and pure-torch reference."""

from __future__ import annotations

import torch

from ._backend import Backend, check_entropy_args, resolve_backend


def softmax_entropy_torch(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Pure-torch reference of :func:`softmax_entropy` (same semantics)."""
    check_entropy_args(logits, temperature)
    z = logits.float() / temperature  # (N, V)
    logp = torch.log_softmax(z, dim=-1)  # (N, V)
    p = logp.exp()  # (N, V)
    plogp = torch.where(p == 0, torch.zeros_like(p), p * logp)  # -inf logits: 0 * -inf := 0 (NaN stays NaN)
    return -plogp.sum(dim=-1)  # (N,)


def softmax_entropy(logits: torch.Tensor, temperature: float = 1.0, backend: Backend = "auto") -> torch.Tensor:
    """Entropy in nats of ``softmax(logits / temperature)`` per row, computed in float32.

    ``logits``: (N, V) float16/bfloat16/float32, any strides. Returns (N,) float32::

        for n in range(N):
            z = float32(logits[n]) / temperature          # -inf entries (masked tokens) stay -inf
            p = exp(z - logsumexp(z))
            out[n] = -sum(p[v] * log(p[v]) for v in range(V) if p[v] != 0)

    A row with every entry -inf has no distribution: its result is NaN.
    ``backend``: "torch", "triton" (CUDA, or any device under TRITON_INTERPRET=1), or "auto"
    (triton for CUDA inputs when triton imports, else torch).
    """
    if resolve_backend(backend, logits) == "triton":
        from .entropy_triton import softmax_entropy_triton

        return softmax_entropy_triton(logits, temperature)
    return softmax_entropy_torch(logits, temperature)
