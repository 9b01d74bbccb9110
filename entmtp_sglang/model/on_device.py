"""The target model on an accelerator, behind the interface the reference engine calls on the CPU.

The engine keeps its bookkeeping (trees, masks, positions, acceptance) and the drafters on the CPU, where
it allocates them. `TargetOnDevice` runs every target pass (prefill, the tree-masked verification pass,
plain decoding) on `device`, with the KV cache there too:

    hidden = target(ids, positions, mask, cache, start)   # inputs moved to the device, the pass runs there,
                                                          # hidden states come back in host_dtype
    logits = target.logits(hidden)                        # on the device, back in host_dtype

so `Engine(TargetOnDevice(target, "cuda"), kind, drafter)` and `generate_plain` run unchanged. On CUDA in
float16/bfloat16 the tree attention goes through FlashInfer's custom mask when flashinfer imports
(`attention="auto"`), else through torch SDPA with the mask.
"""

from __future__ import annotations

import copy

import torch

from .llama import KVCache, LlamaForCausalLM, LlamaShape


class TargetOnDevice:
    """A copy of `target` on `device` in `dtype` (default: the target's), returning host tensors in
    `host_dtype` (default: float32, what the CPU drafters run in)."""

    def __init__(self, target: LlamaForCausalLM, device: str | torch.device, dtype: torch.dtype | None = None,
                 host_dtype: torch.dtype = torch.float32, attention: str = "auto"):
        self.device = torch.device(device)
        self.host_dtype = host_dtype
        self.module = copy.deepcopy(target).to(device=self.device, dtype=dtype or target.lm_head_weight.dtype)
        self.module.eval().requires_grad_(False)
        self.module.set_attention_backend(attention)
        self.dtype = self.module.lm_head_weight.dtype
        self._head_host: torch.Tensor | None = None

    @property
    def shape(self) -> LlamaShape:
        return self.module.shape

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output layer on the host in host_dtype (the EAGLE drafter computes its logits with it)."""
        if self._head_host is None:
            self._head_host = self.module.lm_head_weight.detach().to("cpu", self.host_dtype)
        return self._head_host

    def new_cache(self, batch: int, capacity: int, dtype=None, device=None) -> KVCache:
        return self.module.new_cache(batch, capacity, dtype, device or self.device)

    def _in(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(self.device)

    @torch.no_grad()
    def __call__(self, input_ids, positions=None, mask=None, cache=None, start=None) -> torch.Tensor:
        hidden = self.module(self._in(input_ids), self._in(positions), self._in(mask), cache, self._in(start))
        return hidden.to("cpu", self.host_dtype)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module.logits(hidden.to(self.device, self.dtype)).to("cpu", self.host_dtype)
