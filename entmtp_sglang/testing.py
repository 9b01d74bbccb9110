"""Helpers for the test suite that must live in the package (pytest runs with --import-mode=importlib)."""

from __future__ import annotations

import importlib
import os

REQUIRE_ENV = "ENTMTP_REQUIRE_SGLANG"


def import_sglang_or_skip(module: str = "sglang"):
    """Import an SGLang module for a test module. Without SGLang the module's tests skip, unless
    ENTMTP_REQUIRE_SGLANG=1 (set by CI), where a missing SGLang is an error."""
    import pytest

    try:
        return importlib.import_module(module)
    except Exception as e:  # pragma: no cover - depends on the environment
        if os.environ.get(REQUIRE_ENV) == "1":
            raise RuntimeError(f"{REQUIRE_ENV}=1 but {module} does not import ({e}); run `make sglang`") from e
        pytest.skip("SGLang is not installed (make sglang)", allow_module_level=True)
