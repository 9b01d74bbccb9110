"""The SGLang adapter: the only part of entmtp-sglang that knows SGLang's names.

Importing this package needs torch only, never SGLang. `plugin.py` is the `sglang.srt.plugins` entry point:
it registers the ENTMTP algorithm (`algorithm.py`, `worker.py`), the `entmtp_torch` attention backend
(`attention.py`) and hooks (`admission.py`: bad requests get 400; `sampling.py`: exact sampled verification
on CPU; `observe.py` + `recording.py`: calibration records from verified steps). `cpu_ops.py` holds
pure-torch versions of the `sgl_kernel` CPU ops SGLang 0.5.23's CPU path imports.
"""

from .cpu_ops import CPU_OP_NAMES, InstallOutcome, install_if_missing, sglang_platform_plugin

__all__ = ["CPU_OP_NAMES", "InstallOutcome", "install_if_missing", "sglang_platform_plugin"]
