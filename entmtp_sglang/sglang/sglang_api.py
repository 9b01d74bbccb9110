"""Every SGLang name the adapter uses, imported in one place (SGLang 0.5.23).

Importing this module imports SGLang; the rest of entmtp_sglang never does. When SGLang moves one of
these, this is the only file to change, and the import error names the missing piece.
"""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

__all__ = ["AttentionBackend", "KVWriteLoc"]
