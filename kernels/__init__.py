"""EntMTP kernels: one public function per op, each with ``backend="auto" | "torch" | "triton"``.

"auto" runs the Triton kernel for CUDA inputs when triton imports, else the pure-torch reference.
Triton is imported lazily, only when a Triton kernel runs, so this package imports without it.
Under ``TRITON_INTERPRET=1`` (set before triton is imported) an explicit ``backend="triton"``
also runs on CPU tensors, through Triton's interpreter.
"""

from ._backend import Backend, triton_available
from .entropy import softmax_entropy, softmax_entropy_torch
from .tree_mask import tree_ancestor_mask, tree_ancestor_mask_torch
from .verify_greedy import verify_tree_greedy, verify_tree_greedy_torch

__all__ = [
    "Backend",
    "softmax_entropy",
    "softmax_entropy_torch",
    "tree_ancestor_mask",
    "tree_ancestor_mask_torch",
    "triton_available",
    "verify_tree_greedy",
    "verify_tree_greedy_torch",
]
