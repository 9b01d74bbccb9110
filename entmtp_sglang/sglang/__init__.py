"""The SGLang adapter: the only part of entmtp-sglang that knows SGLang's names.

Importing this package needs torch only, never SGLang. `plugin.py` is the `sglang.srt.plugins` entry point:
it registers the ENTMTP algorithm (`algorithm.py`, `worker.py`), the `entmtp_torch` attention backend
(`cpu/attention.py`) and hooks (`admission.py`: bad requests get 400; `cpu/sampling.py`: exact sampled verification
on CPU; `observe.py` + `recording.py`: calibration records from verified steps). `cpu/` holds what makes SGLang
0.5.23 run on CPU: `cpu/ops.py`, pure-torch versions of the `sgl_kernel` CPU ops its CPU path imports, the
row-wise ops and linear hooks, sampling, the attention backend (see `cpu/__init__.py`).
"""

from .cpu.ops import CPU_OP_NAMES, CPU_OPS, InstallOutcome, install_if_missing, sglang_platform_plugin

__all__ = ["CPU_OPS", "CPU_OP_NAMES", "InstallOutcome", "install_if_missing", "sglang_platform_plugin"]
