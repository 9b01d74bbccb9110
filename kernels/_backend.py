"""Backend selection shared by the kernel dispatchers (xgrammar-style ``backend=`` argument)."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Literal

import torch

Backend = Literal["auto", "torch", "triton"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` succeeds (checked once, lazily)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def flashinfer_available() -> bool:
    """True when ``import flashinfer`` succeeds (checked once, lazily; FlashInfer compiles its kernels with
    nvcc at first use, so importing it is cheap but a kernel's first run is not)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing tvm_ffi, cuda-python, ...)
        return False
    return True


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, x: torch.Tensor) -> Literal["torch", "triton"]:
    """Map ``"auto" | "torch" | "triton"`` to the backend that will run for input ``x``.

    "auto" picks triton only for CUDA inputs with triton importable. An explicit "triton" needs a
    CUDA input, or any device under ``TRITON_INTERPRET=1``.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if x.is_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ImportError("backend='triton' requested but triton is not installed")
        if not x.is_cuda and not triton_interpret():
            raise ValueError(
                f"backend='triton' needs a CUDA tensor (got device {x.device}); "
                "set TRITON_INTERPRET=1 before importing triton to run it on CPU"
            )
        return "triton"
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")


@contextlib.contextmanager
def device_of(x: torch.Tensor) -> Iterator[None]:
    """Make ``x``'s CUDA device current for a kernel launch (no-op for CPU tensors)."""
    if x.is_cuda:
        with torch.cuda.device(x.device):
            yield
    else:
        yield


def check_tree_args(parents: torch.Tensor, num_nodes: torch.Tensor) -> None:
    """Shape/dtype checks shared by the tree ops (no data-dependent checks: those would sync)."""
    if parents.dim() != 2:
        raise ValueError(f"parents must be (B, N), got shape {tuple(parents.shape)}")
    if num_nodes.shape != parents.shape[:1]:
        raise ValueError(f"num_nodes must be (B,) = {tuple(parents.shape[:1])}, got {tuple(num_nodes.shape)}")
    if parents.dtype not in (torch.int32, torch.int64) or num_nodes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"parents/num_nodes must be integer tensors, got {parents.dtype}/{num_nodes.dtype}")
    if num_nodes.device != parents.device:
        raise ValueError("parents and num_nodes must be on the same device")


def check_entropy_args(logits: torch.Tensor, temperature: float) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"logits must be float16/bfloat16/float32, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have V >= 1 columns")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def check_verify_args(
    parents: torch.Tensor, num_nodes: torch.Tensor, draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> None:
    check_tree_args(parents, num_nodes)
    if parents.shape[1] == 0:
        raise ValueError("trees need N >= 1 node slots (node 0 is the root)")
    for name, t in (("draft_tokens", draft_tokens), ("target_argmax", target_argmax)):
        if t.shape != parents.shape:
            raise ValueError(f"{name} must have the shape of parents {tuple(parents.shape)}, got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        if t.device != parents.device:
            raise ValueError(f"{name} must be on the device of parents")
