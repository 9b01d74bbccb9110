"""A pure-torch attention backend for SGLang that also does speculative decoding: `entmtp_torch`.

SGLang's own CPU backends cannot run EAGLE-style speculation on a CPU without AMX (`torch_native` has no
draft-decode or tree-verify path; `intel_amx` needs AMX kernels). This one serves every forward mode the
EAGLE family uses, with one code path: for each query row it gathers the row's keys and values from the
KV pool by explicit slot indices, builds a boolean visibility mask, and runs one batched
`scaled_dot_product_attention`.

* EXTEND / DRAFT_EXTEND: causal over `req_to_token[req, :seq_len]`, queries are the last
  `extend_seq_len` positions.
* DECODE: one query per request over `req_to_token[req, :seq_len]`.
* TARGET_VERIFY: `draft_token_num` queries per request over the prefix and the draft tokens; the
  draft-to-draft part of the mask is SGLang's tree mask (`spec_info.custom_mask`, QLEN_ONLY layout on
  CPU: request b's block is `custom_mask[b*n*n:(b+1)*n*n].view(n, n)`), the prefix is always visible.
  A ragged verify (its spec_info carries `entmtp_ragged`, a `ragged.RaggedVerify`) runs only each row's
  real nodes, packed: the same visibility for those queries (`ragged.ragged_verify_plan`).
* Draft decode (`MultiStepDraftBackend`, one child per draft step): `topk` rows per request. By default
  a row sees the prefix and its own column of draft slots, as SGLang's EAGLE draft kernels do; a
  worker that drafts a fixed tree (ENTMTP) attaches per-row ancestor slots instead (`set_draft_rows`),
  so every drafted node attends exactly to its ancestors.

Nothing here imports SGLang at module level except through `sglang_api`, which the plugin loads.
"""

from __future__ import annotations

import torch

from ..ragged import ragged_verify_plan
from ..sglang_api import AttentionBackend, KVWriteLoc
from .gather import _Plan, _ragged_rows, attend, decode_plan, extend_plan, rows_plan, verify_plan

NAME = "entmtp_torch"
RAGGED_ATTR = "entmtp_ragged"   # on a verify's spec_info, a `ragged.RaggedVerify`: the forward's tokens are packed


class TorchTreeAttnBackend(AttentionBackend):
    """Target and draft-extend backend (and one child per draft step of `MultiStepDraftBackend`)."""

    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.plan: _Plan | None = None
        self.draft_plan: _Plan | None = None    # set by the multi-step container for draft decode
        self.ragged = None                       # the ragged verify `plan` was made for (None: not ragged)

    # -- metadata -----------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        mode = forward_batch.forward_mode
        r2t = self.req_to_token_pool.req_to_token
        self.ragged = None
        if mode.is_idle():
            self.plan = None
        elif mode.is_target_verify():
            spec = forward_batch.spec_info
            if spec is None:
                raise RuntimeError("entmtp_torch: TARGET_VERIFY batch without spec_info")
            ragged = self.ragged = getattr(spec, RAGGED_ATTR, None)
            if ragged is not None:   # only the rows' real tokens, packed (ragged.py)
                self.plan = ragged_verify_plan(r2t, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                               int(spec.draft_token_num), getattr(spec, "custom_mask", None),
                                               ragged.real, ragged.counts)
            else:
                self.plan = verify_plan(r2t, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                        int(spec.draft_token_num), getattr(spec, "custom_mask", None))
        elif mode.is_decode():
            self.plan = decode_plan(r2t, forward_batch.req_pool_indices, forward_batch.seq_lens)
        else:
            self.plan = extend_plan(r2t, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                    forward_batch.extend_seq_lens)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        return 1

    def support_triton(self) -> bool:
        return False

    # -- forward ------------------------------------------------------------------------------------
    def _run(self, q, k, v, layer, forward_batch, save_kv_cache: bool, plan: _Plan):
        if layer.is_cross_attention:
            raise NotImplementedError("entmtp_torch: cross-attention is not supported")
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        attend(plan, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
               self.token_to_kv_pool.get_key_buffer(layer.layer_id),
               self.token_to_kv_pool.get_value_buffer(layer.layer_id),
               layer.scaling, out.view(-1, layer.tp_q_head_num, layer.v_head_dim))
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        verify = forward_batch.forward_mode.is_target_verify()
        ragged = getattr(forward_batch.spec_info, RAGGED_ATTR, None) if verify else None
        if ragged is not None and ragged is not self.ragged:   # planned before the worker packed the verify
            self.init_forward_metadata(forward_batch)
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, self.plan)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        plan = self.draft_plan if self.draft_plan is not None else self.plan
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, plan)


class MultiStepDraftBackend:
    """The draft-decode container SGLang's EAGLE draft loop expects: `attn_backends[i]` runs step i.

    Draft slots follow SGLang's layout: request b's `topk * num_steps` slots start at
    `req_to_token[req, seq_len]`, column c (branch) step s at offset `c * num_steps + s`. At step i, row
    (b, c) writes its K/V at column c step i. What a row attends to besides the prefix:
    * default (SGLang EAGLE): its own column's steps 0..i;
    * with `set_draft_rows(offsets, valid)` (a worker drafting a fixed tree): the listed offsets,
      `offsets[i]` of shape (topk, A) — the slots of the row's ancestors and itself — or (bs, topk, A) when
      each request of the batch drafts its own tree.
    """

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [TorchTreeAttnBackend(model_runner)
                              for _ in range(max(speculative_num_steps - 1, 0))]
        self.req_to_token_pool = model_runner.req_to_token_pool
        self._rows: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def set_draft_rows(self, offsets: list[torch.Tensor] | None, valid: list[torch.Tensor] | None = None):
        self._rows = None if offsets is None else (offsets, valid)

    def default_rows(self, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        cols = torch.arange(self.topk, device=device)[:, None] * self.speculative_num_steps
        off = cols + torch.arange(step + 1, device=device)[None, :]
        return off, torch.ones_like(off, dtype=torch.bool)

    def init_forward_metadata(self, forward_batch) -> None:
        r2t = self.req_to_token_pool.req_to_token
        rpi = forward_batch.req_pool_indices.long()
        seq = forward_batch.seq_lens.long()
        bs, topk = seq.shape[0], self.topk
        pre_idx, pre_valid = _ragged_rows(r2t, rpi, seq)
        pre_idx = pre_idx.repeat_interleave(topk, 0)
        pre_valid = pre_valid.repeat_interleave(topk, 0)
        steps = len(self.attn_backends) if self._rows is None else min(len(self.attn_backends), len(self._rows[0]))
        for step, child in enumerate(self.attn_backends[:steps]):
            if self._rows is None:
                off, val = self.default_rows(step, seq.device)
            else:
                off, val = self._rows[0][step], self._rows[1][step]
            if off.dim() == 2:   # one tree for the batch: the same rows for every request
                off, val = off[None].expand(bs, -1, -1), val[None].expand(bs, -1, -1)
            # (bs, topk, A) absolute positions in req_to_token -> slots
            pos = seq[:, None, None] + off.long()
            slots = r2t[rpi[:, None, None], pos.clamp(max=r2t.shape[1] - 1)].long()
            slots = slots.reshape(bs * topk, -1)
            v = val.reshape(bs * topk, -1)
            child.draft_plan = rows_plan(pre_idx, pre_valid, torch.where(v, slots, 0), v)
            child.plan = None
