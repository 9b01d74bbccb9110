"""Linear layers on the CPU, float32: one place that picks, per machine, a batch-invariant path for every linear
layer of the reference engine and of SGLang with this plugin (`sglang/cpu/linear.py`).

Why a choice at all. Decoding multiplies a few rows by weights far larger than the cache: a plain step one row per
request, a verify step one per tree node. Speculation only pays if a verify over a few nodes costs about what one
row costs, and greedy speculative output only equals plain decoding bit for bit if a row's result does not depend
on how many rows share the call (batch invariance). The paths:

- ``fewrow``: `kernels/fewrow_linear.cpp` (weights packed once, each block streamed once for all rows, each
  output one fixed chain of FMAs): batch-invariant by construction; on SmolLM2's shapes about as fast as
  `F.linear` at one row (1.04x on the Intel Xeon) and far cheaper at 2-16 (`bench/results/linear_paths.md`).
  Needs the C++ compiler once (`entmtp kernels`).
- ``onednn``: oneDNN's linear on a weight packed once (`torch.ops.mkldnn._linear_pointwise`), fewer than
  `MIN_ROWS` rows padded to `MIN_ROWS` (oneDNN computes a single row with other rounding): batch-invariant as
  used; fast on some processors (an AMD EPYC), about twice `F.linear`'s cost at one row on others (an Intel Xeon).
- ``torch``: `F.linear`. Taken only where the probe finds it batch-invariant on the shapes at hand (it was not on
  the machines seen so far: MKL rounds one row differently from several), or where asked.

`choose_path()` measures the candidates once per machine (processor, torch version, threads, kernel source) on a
probe of decoder-sized weights at 1, 2, 4 and 8 rows, keeps the fastest batch-invariant one, caches the choice in
`$ENTMTP_CACHE/linear_path.json` and logs it in one line. ``ENTMTP_LINEAR=fewrow|onednn|torch`` forces a path
(``ENTMTP_ONEDNN=0``, the older switch, means ``torch``). Everything else (other devices and dtypes, autograd)
takes `F.linear`. Results differ from `F.linear`'s by float rounding only.

`linear(x, weight, bias)` is the entry point; `Linear` is an `nn.Linear` that keeps its packed copy; `PackedWeight`
caches one packed copy (as large as the weight) of one weight or of several stacked along the output dimension,
rebuilt when a weight changes in place or is replaced.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fewrow_linear as fewrow
from ..settings import settings
from .prepare import cache_root

PATHS = ("fewrow", "onednn", "torch")
MIN_ROWS = 6   # oneDNN computes a single row apart (a 1536-wide input: other rounding); 6 rows cost what 1 does
PROBE_ROWS = (1, 2, 4, 8)
log = logging.getLogger("entmtp_sglang.linear")


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_HAS_ONEDNN = _onednn_available()


def forced_path() -> str | None:
    """The path the environment asks for, if any (an unknown name is an error that names the choices)."""
    env = settings()   # ENTMTP_LINEAR takes auto or one of PATHS, checked as it is read
    if not env.onednn:
        return "torch"
    return None if env.linear == "auto" else env.linear


# --- the paths, each as (pack the weight, multiply) -----------------------------------------------------------

def _pack_onednn(dense: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(dense, None)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows < MIN_ROWS:
        flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
    elif not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


_PACK = {"fewrow": fewrow.pack, "onednn": _pack_onednn, "torch": lambda dense: dense}
_MULTIPLY = {"fewrow": fewrow.fewrow_linear_packed, "onednn": _onednn_linear, "torch": F.linear}


def _packer(path: str):
    return _PACK[path]


def _multiply(path: str):
    return _MULTIPLY[path]


def _candidates() -> list[str]:
    out = []
    if fewrow.available():
        out.append("fewrow")
    if _HAS_ONEDNN:
        out.append("onednn")
    return out + ["torch"]


# --- the choice ---------------------------------------------------------------------------------------------

def _probe_weights() -> list[torch.Tensor]:
    """Decoder-sized weights (SmolLM2's projections and a slice of an output layer), about 60 MB: past the
    private caches, so a step reads them from memory as a real model's step does."""
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (8192, 576)] * 4
    return [torch.randn(o, k, generator=g) * 0.02 for o, k in shapes]


def batch_invariant(path: str, weights: list[torch.Tensor], rows: int = 16) -> bool:
    """Whether each row's result is bit-identical computed alone and among 2..`rows` others, on `weights`."""
    pack, mul = _packer(path), _multiply(path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in weights:
            p = pack(w)
            x = torch.randn(rows, w.shape[1], generator=g)
            full = mul(x, p, None)
            for n in (1, 2, 3, 5, 8, 13):
                if n <= rows and not torch.equal(mul(x[:n], p, None), full[:n]):
                    return False
    return True


def measure(paths: list[str], weights: list[torch.Tensor], rows=PROBE_ROWS, repeats: int = 7) -> dict[str, dict]:
    """Seconds of one pass over `weights` per path and row count: the fastest of `repeats` passes (another
    process on the cores only ever adds time), paths interleaved pass by pass."""
    best: dict[str, dict] = {p: {n: float("inf") for n in rows} for p in paths}
    with torch.no_grad():
        packed = {p: [_packer(p)(w) for w in weights] for p in paths}
        xs = {n: {k: torch.randn(n, k) for k in {w.shape[1] for w in weights}} for n in rows}
        for i in range(repeats + 1):
            for n in rows:
                for p in paths:
                    mul = _multiply(p)
                    t = time.perf_counter()
                    for w, pw in zip(weights, packed[p]):
                        mul(xs[n][w.shape[1]], pw, None)
                    if i:  # the first pass warms up
                        best[p][n] = min(best[p][n], time.perf_counter() - t)
    return best


def _cache_file() -> Path:
    return cache_root() / "linear_path.json"


def _machine_key() -> str:
    src = fewrow.SOURCE.read_bytes() if fewrow.SOURCE.exists() else b""
    return "|".join([fewrow._cpu_key(), torch.__version__, f"threads={torch.get_num_threads()}",
                     hashlib.sha256(src).hexdigest()[:12], ",".join(_candidates())])


def _decide() -> dict:
    weights = _probe_weights()
    invariant = {p: (p == "fewrow" or batch_invariant(p, weights[:5])) for p in _candidates()}
    usable = [p for p, ok in invariant.items() if ok]
    times = measure(usable, weights)
    total = {p: sum(t.values()) for p, t in times.items()}
    path = min(total, key=total.get) if total else "torch"
    return {"path": path, "invariant": invariant,
            "ms": {p: {str(n): round(t * 1e3, 3) for n, t in ts.items()} for p, ts in times.items()},
            "isa": fewrow.isa() if "fewrow" in invariant else None}


def _summary(d: dict) -> str:
    parts = []
    for p, ok in d["invariant"].items():
        if not ok:
            parts.append(f"{p}: not batch-invariant")
        elif p in d["ms"]:
            parts.append(f"{p} " + "/".join(f"{v:.1f}" for v in d["ms"][p].values()) + " ms")
    rows = "/".join(str(n) for n in PROBE_ROWS)
    isa = f" ({d['isa']})" if d["path"] == "fewrow" and d.get("isa") else ""
    return f"entmtp: CPU linear layers take the {d['path']} path{isa}; probe at {rows} rows: " + ", ".join(parts)


@functools.lru_cache(maxsize=None)
def choose_path() -> str:
    """The path this machine's float32 CPU linear layers take (module docstring); measured once, then cached."""
    forced = forced_path()
    if forced is not None:
        if forced == "fewrow" and not fewrow.available():
            raise RuntimeError(f"ENTMTP_LINEAR=fewrow, but the kernel is unavailable: {fewrow.unavailable_reason()}")
        if forced == "onednn" and not _HAS_ONEDNN:
            raise RuntimeError("ENTMTP_LINEAR=onednn, but this torch has no oneDNN linear")
        return forced
    candidates = _candidates()
    if candidates == ["torch"]:
        return "torch"
    key = _machine_key()
    cache = _cache_file()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(cache.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others (tp ranks, ...) read its choice
            try:
                known = json.loads(cache.read_text())
            except (OSError, ValueError):
                known = {}
            d = known.get(key)
            if d is None or d.get("path") not in candidates:
                d = _decide()
                known[key] = d
                cache.write_text(json.dumps(known, indent=1))
                log.warning(_summary(d))
            else:
                log.info(_summary(d))
    except OSError:  # no writable cache: measure for this process alone
        d = _decide()
        log.warning(_summary(d))
    return d["path"]


def describe() -> dict:
    """What `choose_path` decided here and why (for `entmtp kernels`, reports and logs)."""
    path = choose_path()
    try:
        known = json.loads(_cache_file().read_text()).get(_machine_key(), {})
    except (OSError, ValueError):
        known = {}
    return {"path": path, "forced": forced_path(), "fewrow": fewrow.isa(), "onednn": _HAS_ONEDNN,
            "probe_ms": known.get("ms"), "invariant": known.get("invariant")}


def applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `x @ weight.T` takes the chosen packed path: float32 on the CPU, no autograd, a packing path."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled() and x.numel() > 0
            and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)
            and choose_path() != "torch")


class PackedWeight:
    """A packed copy of one weight, or of several stacked along the output dimension (one call computes a
    layer's q, k and v projections together), for the chosen path; rebuilt when any of them changes in place or
    is replaced."""

    __slots__ = ("_key", "packed", "path")

    def __init__(self):
        self._key: tuple = ()
        self.packed = None
        self.path: str | None = None

    def __deepcopy__(self, memo) -> "PackedWeight":
        return PackedWeight()  # a copied module packs its own (copied) weights on first use

    def __reduce__(self):
        return (PackedWeight, ())  # packed tensors do not pickle; a loaded module packs again

    def get(self, weights: tuple[torch.Tensor, ...]):
        key, path = self._key, choose_path()
        if (path != self.path or len(key) != len(weights)
                or any(r() is not w or v != w._version for (r, v), w in zip(key, weights))):
            dense = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.packed = _packer(path)(dense.detach().contiguous())
            self.path = path
            self._key = tuple((weakref.ref(w), w._version) for w in weights)
        return self.packed


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` for W packed by `PackedWeight.get` (call only where `applies`)."""
    path = "fewrow" if isinstance(packed, fewrow.FewRowWeight) else "onednn" if packed.is_mkldnn else "torch"
    return _multiply(path)(x, packed, bias)


_free: dict[int, PackedWeight] = {}  # id(weight) -> its packed copy, for weights that no Linear module owns


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           cache: PackedWeight | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the chosen packed path where that applies (module docstring).
    `cache` holds the packed copy (a `Linear` passes its own); without one it is kept per weight."""
    if not applies(x, weight, *(() if bias is None else (bias,))):
        return F.linear(x, weight, bias)
    if cache is None:
        cache = _free.get(id(weight))
        if cache is None:
            cache = _free[id(weight)] = PackedWeight()
            for k in [k for k, c in _free.items() if c._key and c._key[0][0]() is None]:
                del _free[k]
    return packed_linear(x, cache.get((weight,)), bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) whose forward is `linear`, packed copy kept here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed)
