"""Draft trees: the canonical parent-array form, derived buffers, importers and tree sets."""

from .topology import Tree, TreeBuffers, TreeError, build_buffers, from_medusa_choices, from_sglang

__all__ = ["Tree", "TreeBuffers", "TreeError", "build_buffers", "from_medusa_choices", "from_sglang"]
