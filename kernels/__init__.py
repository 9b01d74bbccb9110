"""EntMTP kernels: one public function per op, each with ``backend="auto" | "torch" | "triton"``
(tree attention: ``"auto" | "torch" | "flashinfer"``).

The few-row linear layer (float32 on the CPU, batch-invariant) lives in its own module,
``entmtp_sglang.kernels.fewrow_linear`` (``fewrow_linear(..., backend="auto" | "cpu" | "torch")``): a C++ kernel
built with the machine's compiler on first use, beside its float64 torch reference.

"auto" runs the Triton kernel (FlashInfer for tree attention) for CUDA inputs when it imports, else the
pure-torch reference. Triton and FlashInfer are imported lazily, only when one of their kernels runs, so
this package imports without them.
Under ``TRITON_INTERPRET=1`` (set before triton is imported) an explicit ``backend="triton"``
also runs on CPU tensors, through Triton's interpreter.
"""

from ._backend import Backend, flashinfer_available, triton_available
from .entropy import softmax_entropy, softmax_entropy_torch
from .tree_attention import (
    AttentionBackend,
    pack_tree_mask_torch,
    segment_packbits_torch,
    tree_attention,
    tree_attention_torch,
    unpack_tree_mask_torch,
)
from .tree_mask import tree_ancestor_mask, tree_ancestor_mask_torch
from .verify_greedy import verify_tree_greedy, verify_tree_greedy_torch

__all__ = [
    "AttentionBackend",
    "Backend",
    "flashinfer_available",
    "pack_tree_mask_torch",
    "segment_packbits_torch",
    "softmax_entropy",
    "softmax_entropy_torch",
    "tree_ancestor_mask",
    "tree_ancestor_mask_torch",
    "tree_attention",
    "tree_attention_torch",
    "triton_available",
    "unpack_tree_mask_torch",
    "verify_tree_greedy",
    "verify_tree_greedy_torch",
]
