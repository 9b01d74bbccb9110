"""The SGLang adapter (groundwork): the only part of entmtp-sglang that knows SGLang's names.

Importing this package needs torch only, never SGLang. So far it holds `cpu_ops`: pure-torch
versions of the `sgl_kernel` CPU ops that SGLang 0.5.23's CPU path imports, and
`install_if_missing()`, which exposes them where SGLang looks them up. docs/SGLANG.md is the plan for
the rest of the integration (plugin entry point, the ENTMTP speculative algorithm, a CPU attention
backend for tree verify).
"""

from .cpu_ops import CPU_OP_NAMES, InstallOutcome, install_if_missing, sglang_platform_plugin

__all__ = ["CPU_OP_NAMES", "InstallOutcome", "install_if_missing", "sglang_platform_plugin"]
