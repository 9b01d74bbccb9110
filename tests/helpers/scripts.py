"""Loading the benchmark scripts of bench/ (not a package) in tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str, folder: str = "bench"):
    """A script of bench/ (the product's benchmarks) or, with folder="bench/experiments", a one-off experiment,
    entered in `sys.modules` as an import would (a dataclass defined under `from __future__ import annotations`
    looks its module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return mod
