"""Resting and catching up: a step where the drafter does not run, and the one pass that brings it back.

A resting step (the policy's chain:0, or a rule: penalties, a request that never drafts) verifies each row's root
alone (and its spans, forced_draft.py) and skips the draft model's extend pass. Each request then owes its drafter
the positions the step verified and accepted: the token the target chose at each and the target's hidden state there
(`Resting.owe`, kept in the request's entry of the `RequestTable`, so a request that ends while resting takes its
debt with it). When the request speculates again, `Resting.catch_up` runs one draft-extend pass over every owed
position of the batch, as the draft extend of a speculative step would have, and leaves the next root's top-k,
hidden state and signal in the batch's draft input.

    step t     rest: verify [root]            owe (tok_t, hid_t)
    step t+1   rest: verify [root, span...]   owe (tok_t+1, hid_t+1), (tok_t+2, hid_t+2)   (a span's accepted part)
    step t+2   speculate: catch_up over the 3 owed positions, then draft the tree as usual

No SGLang import: SGLang's batch and verify result are read and written through their attributes.
"""

from __future__ import annotations

import torch

from .requests import RequestTable

MAX_OWED = 16   # rested positions a request may owe the drafter before a catch-up runs regardless (at least the
                # longest rest plus one: penalised batches rest to their end)


def needs_plain_decoding(reqs) -> bool:
    """Whether some request of the batch must decode one token per step to match plain decoding.

    SGLang applies frequency, presence and repetition penalties and min_new_tokens "relaxed" under
    speculation: one penalty row for every node of a tree, and one counted token per step, so a penalised
    greedy request's output differs from the non-speculative server's. Decoded one token per step from its
    first decode step it is exact: with ragged verify as a resting row of a speculating step, else (SGLang verifies
    one node count per batch) the whole batch decodes plainly."""
    for r in reqs:
        if penalised(r):
            return True
        sp = getattr(r, "sampling_params", None)
        if sp is not None and (getattr(sp, "min_new_tokens", 0) or 0) > len(getattr(r, "output_ids", ()) or ()):
            return True
    return False


def penalised(req) -> bool:
    """Whether the request carries a frequency, presence or repetition penalty: it decodes plainly to its end, so
    its drafter is never needed again (min_new_tokens, by contrast, ends)."""
    sp = getattr(req, "sampling_params", None)
    if sp is None:
        return False
    return ((getattr(sp, "frequency_penalty", 0.0) or 0.0) != 0.0
            or (getattr(sp, "presence_penalty", 0.0) or 0.0) != 0.0
            or (getattr(sp, "repetition_penalty", 1.0) or 1.0) != 1.0)


class Resting:
    """The resting part of the worker. `requests`: the per-request table (each entry's `owed`); `never_drafts(req)`:
    a request whose rested positions are not kept (it never drafts again)."""

    def __init__(self, requests: RequestTable, never_drafts, max_owed: int = MAX_OWED):
        self.requests, self.never_drafts, self.max_owed = requests, never_drafts, max_owed

    def owed(self, reqs) -> int:
        """The most positions a request of the batch owes its drafter."""
        return max((len(st.owed) for r in reqs if (st := self.requests.get(r)) is not None), default=0)

    def owe(self, batch, batch_result) -> None:
        """After a resting step's verify: each request owes its drafter the positions just verified and accepted (its
        root, and the accepted part of its span when the step had one)."""
        tokens = batch_result.next_token_ids
        hidden = batch_result.logits_output.hidden_states
        reqs = batch.reqs
        bs = len(reqs)
        width = tokens.shape[0] // bs if tokens is not None and bs else 0
        lens = batch_result.accept_lens
        if not (width and hidden is not None and tokens.shape[0] == bs * width == hidden.shape[0]
                and (width == 1 or lens is not None)):
            # an unexpected layout: nothing to catch up from, so the drafter starts cold (still lossless)
            for r in reqs:
                self.requests.of(r).owed = []
            return
        # a graph's output buffers are reused next step; a chain's accepted tokens lead its row (verify). One copy
        # per row, so an entry never keeps a view of the whole step's hidden states alive.
        tokens, hidden = tokens.view(bs, width), hidden.view(bs, width, -1)
        counts = [1] * bs if width == 1 else [max(1, min(int(n), width)) for n in lens.tolist()]
        for i, r in enumerate(reqs):
            st = self.requests.of(r)
            if self.never_drafts(r):   # nothing to catch up
                st.owed = []
                continue
            row_t, row_h = tokens[i, : counts[i]].clone(), hidden[i, : counts[i]].clone()
            st.owed.extend((row_t[j], row_h[j]) for j in range(counts[i]))

    def catch_up(self, batch, draft_worker, extend_for_decode, req_to_token, after) -> None:
        """One draft-extend pass (`extend_for_decode`, SGLang's) over every position the batch's requests rested
        through: writes their draft KV and leaves the next root's top-k, hidden state and signal in `batch.spec_info`,
        as the draft extend of a speculative step would. Request i owes k_i positions ending just before its current
        length; the pass is R = max k_i wide, and a shorter row's padding writes to SGLang's dummy KV slot 0, past the
        row's real positions (causal attention keeps them out of the real ones). `after(batch)` reads the pass's
        root logits (the worker's signals); a request that owed nothing (joined since) keeps its root state."""
        reqs = batch.reqs
        states = [self.requests.of(r) for r in reqs]
        owed = []
        for st in states:
            owed.append(st.owed)
            st.owed = []
        width = max(len(o) for o in owed)
        bs, dev = len(reqs), batch.seq_lens.device
        hidden0 = next(o for o in owed if o)[0][1]
        tokens = torch.zeros(bs, width, dtype=torch.int64, device=dev)
        hidden = hidden0.new_zeros((bs, width, hidden0.shape[-1]))
        k = torch.tensor([len(o) for o in owed], dtype=torch.long)
        for i, o in enumerate(owed):
            if o:
                tokens[i, : len(o)] = torch.stack([t for t, _ in o]).to(tokens)
                hidden[i, : len(o)] = torch.stack([h for _, h in o])
        k_dev = k.to(dev)
        start = batch.seq_lens.long() - k_dev                    # the first owed position of each request
        pos = start[:, None] + torch.arange(width, device=dev)[None, :]
        slots = req_to_token[batch.req_pool_indices.long()[:, None], pos.clamp(min=0, max=req_to_token.shape[1] - 1)]
        real = torch.arange(width, device=dev)[None, :] < k_dev[:, None]
        out_cache_loc = torch.where(real, slots.long(), 0).flatten()    # SGLang's slot indices are int64

        di = batch.spec_info
        cold = [i for i, o in enumerate(owed) if not o]          # joined since: their root state stays
        kept = (di.topk_p, di.topk_index, di.hidden_states) if cold else None
        kept_signals = {i: (states[i].signal, states[i].probs) for i in cold}
        fields = ("forward_mode", "spec_info", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "input_ids",
                  "out_cache_loc", "prefix_lens", "extend_lens", "extend_num_tokens")
        saved = {f: getattr(batch, f, None) for f in fields}
        ndt = draft_worker.speculative_num_draft_tokens
        try:
            batch.seq_lens = start.to(batch.seq_lens.dtype)
            if batch.seq_lens_cpu is not None:
                batch.seq_lens_cpu = batch.seq_lens_cpu - k.to(batch.seq_lens_cpu.dtype)
                batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
            batch.out_cache_loc = out_cache_loc
            draft_worker.speculative_num_draft_tokens = width
            result = _CatchUp(accept_lens=k_dev.clamp(min=1).to(torch.int32), next_token_ids=tokens.flatten(),
                              logits_output=_Hidden(hidden.flatten(0, 1)), next_draft_input=di,
                              new_seq_lens=batch.seq_lens)
            extend_for_decode(batch, result)
        finally:
            draft_worker.speculative_num_draft_tokens = ndt
            for f, v in saved.items():
                setattr(batch, f, v)
        after(batch)
        if cold:
            idx = torch.tensor(cold, dtype=torch.long, device=dev)
            p, t, h = kept
            di.topk_p[idx], di.topk_index[idx] = p[idx], t[idx]
            if h is not None and di.hidden_states is not None:
                di.hidden_states[idx] = h[idx]
            for i, (sig, probs) in kept_signals.items():
                if sig is not None:
                    states[i].signal, states[i].probs = sig, probs


class _Hidden:
    """The part of a verify's logits output a draft extend reads."""

    def __init__(self, hidden_states: torch.Tensor):
        self.hidden_states = hidden_states


class _CatchUp:
    """What `EagleDraftWorker._draft_extend_for_decode` reads of a verify result, for the catch-up pass."""

    prepared_draft_extend_inputs = None

    def __init__(self, accept_lens, next_token_ids, logits_output, next_draft_input, new_seq_lens):
        self.accept_lens, self.next_token_ids = accept_lens, next_token_ids
        self.logits_output, self.next_draft_input, self.new_seq_lens = logits_output, next_draft_input, new_seq_lens
