"""Every SGLang name the adapter uses, imported in one place (SGLang 0.5.23).

Importing this module imports SGLang; the rest of entmtp_sglang never does. When SGLang moves one of
these, this is the only file to change, and the import error names the missing piece.
"""

from __future__ import annotations

import contextlib

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.cuda_graph_config import Backend as GraphBackend
from sglang.srt.model_executor.cuda_graph_config import Phase as GraphPhase
from sglang.srt.model_executor.cuda_graph_config import with_phase
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import get_context, get_parallel, get_platform, get_spec
from sglang.srt.speculative import spec_registry
from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo
from sglang.srt.utils.hf_transformers_utils import get_config


def __getattr__(name):
    # The worker base class pulls in SGLang's whole scheduler stack; import it only when asked.
    if name == "EAGLEWorkerV2":
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

        return EAGLEWorkerV2
    if name == "SpecRuntimeState":
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        return SpecRuntimeState
    raise AttributeError(name)


@contextlib.contextmanager
def draft_contexts(draft_worker):
    """The contexts upstream's EAGLEWorkerV2.init_cuda_graphs builds its adaptive runtime states in."""
    from sglang.srt.speculative import eagle_worker_v2 as ew

    with (ew.draft_tp_context(draft_worker.parallel_layout), ew.speculative_moe_backend_context(),
          ew.speculative_moe_a2a_backend_context()):
        yield


__all__ = ["AttentionBackend", "CustomSpecAlgo", "EAGLEWorkerV2", "ForwardContext", "ForwardMode",  # noqa: F822
           "GraphBackend", "GraphPhase", "KVWriteLoc", "SpecRuntimeState", "SpeculativeAlgorithm", "draft_contexts",
           "forward_context", "get_config", "get_context", "get_parallel", "get_platform", "get_spec",
           "per_step_draft_out_cache_loc", "spec_registry", "with_phase"]
