"""A batch-invariant few-row linear layer for float32 on the CPU: ``y = x @ weight.T + bias``.

Decoding multiplies a handful of rows (one token per request, or a verified tree's nodes) by weights far larger
than the cache, so a step costs what reading the weights costs. ``fewrow_linear.cpp`` packs a weight once into
blocks of output features and streams each block once for all rows (in tiles of 8 rows on AVX-512, 4 on AVX2),
so 2-8 rows cost little more than one. Each output is one chain of fused multiply-adds in ``k`` order::

    for r, o:  acc = 0;  for k in range(K): acc = fma(x[r, k], weight[o, k], acc);  y[r, o] = acc + bias[o]

whatever the number of rows or the tile a row falls in, so a row computed alone is bit-identical to the same row
computed among others, and the AVX-512, AVX2 and scalar builds agree bit for bit.

The extension is compiled with the machine's C++ compiler against the installed torch (``-O3 -march=native``,
about 7 s) on first use, or ahead of time by ``entmtp kernels`` (``make install`` runs it), into
``$ENTMTP_CACHE/kernels`` (default ``~/.cache/entmtp/kernels``), one build per source, torch version and
processor. Where it cannot be built, ``available()`` is False, one warning says why, and callers take another
path (``model/linear.py``).

``fewrow_linear_torch`` is the reference: the exact sum (float64) rounded once to float32. The kernel's float32
chain differs from it by float32 rounding only.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ..settings import settings

SOURCE = Path(__file__).with_name("fewrow_linear.cpp")
# one extension: the linear kernel and the row-wise ops of a decoder layer (rowwise_ops.py)
SOURCES = (SOURCE, Path(__file__).with_name("rowwise_ops.cpp"))
# -ffp-contract=off: no multiply-add fused where the source does not say so (the element-wise ops then round as
# torch's do, and every vector width agrees); the linear kernel's FMAs are explicit
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
log = logging.getLogger("entmtp_sglang.kernels")


def _cpu_key() -> str:
    """The processor, as far as the compiler's -march=native sees it (model name and flags)."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


def build_dir() -> Path:
    """Where this source, flags, torch installation and processor's build lives. The torch installation's path is
    part of the key: two environments with the same torch version (a checkout's venv and a fresh clone's) compile
    against different include paths, and sharing one directory made each rebuild the library the other had loaded."""
    root = settings().cache_dir
    text = b"".join(p.read_bytes() for p in SOURCES) + " ".join(CFLAGS).encode()
    where = f"{torch.__version__}|{Path(torch.__file__).resolve().parent}".encode()
    key = hashlib.sha256(text + where + _cpu_key().encode()).hexdigest()[:16]
    return root / "kernels" / f"fewrow-{key}"


@functools.lru_cache(maxsize=None)
def _load() -> str | None:
    """Build (or reuse) and load the extension; None when it loaded, else why not."""
    if not settings().fewrow:
        return "ENTMTP_FEWROW=0"
    if hasattr(torch.ops, "entmtp") and hasattr(torch.ops.entmtp, "fewrow_linear"):
        return None  # loaded already (another copy of this module)
    try:
        from torch.utils import cpp_extension

        try:  # the `ninja` wheel (a dependency) where the machine has none on PATH
            import ninja

            if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
        except ImportError:
            pass
        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="entmtp_fewrow", sources=[str(p) for p in SOURCES], build_directory=str(out),
            is_python_module=False, extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], verbose=False)
        torch.ops.entmtp.fewrow_isa()
    except Exception as e:  # no compiler, no headers, a read-only cache, ...
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.warning("entmtp: the few-row linear kernel could not be built (%s); linear layers take another path",
                    reason)
        return reason
    return None


def available() -> bool:
    """Whether the compiled kernel is loaded (building it on first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def isa() -> str:
    """The vector instruction set the kernel was built for: 'avx512', 'avx2' or 'scalar'."""
    return torch.ops.entmtp.fewrow_isa() if available() else "unavailable"


@dataclass(frozen=True)
class FewRowWeight:
    """A weight packed for `fewrow_linear` (blocks of output features, k-major inside a block)."""

    packed: torch.Tensor        # (blocks, in_features, block)
    out_features: int

    @property
    def in_features(self) -> int:
        return self.packed.shape[1]


def pack(weight: torch.Tensor) -> FewRowWeight:
    """Pack a float32 CPU weight (out_features, in_features) once (building the kernel on first use)."""
    if not available():
        raise RuntimeError(f"the few-row linear kernel is unavailable: {unavailable_reason()}")
    return FewRowWeight(torch.ops.entmtp.fewrow_pack(weight.detach()), weight.shape[0])


def fewrow_linear_packed(x: torch.Tensor, weight: FewRowWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for a packed W, x of shape (..., in_features), float32 on the CPU."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.ops.entmtp.fewrow_linear(flat, weight.packed, bias, weight.out_features)
    return out.view(*x.shape[:-1], weight.out_features)


def fewrow_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: each output's exact sum (float64), rounded once to x's dtype."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def fewrow_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  backend: str = "auto") -> torch.Tensor:
    """`x @ weight.T + bias` (float32, CPU). backend: "auto" (the kernel where it is built, else the reference),
    "cpu" (the kernel; an error where it cannot be built), "torch" (the reference). Packs the weight on every
    call: to call it repeatedly, `pack` once and use `fewrow_linear_packed`."""
    if backend not in ("auto", "cpu", "torch"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'cpu' or 'torch'")
    if backend == "torch" or (backend == "auto" and not available()):
        return fewrow_linear_torch(x, weight, bias)
    if not available():
        raise RuntimeError(f"the few-row linear kernel is unavailable: {unavailable_reason()}")
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"fewrow_linear runs float32 CPU tensors, got {x.dtype} on {x.device}")
    return fewrow_linear_packed(x, pack(weight), bias)
