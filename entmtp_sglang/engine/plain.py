"""Plain autoregressive decoding, one token per target pass: the reference speculation must equal."""

from __future__ import annotations

import torch

from ..model.llama import LlamaForCausalLM
from .sampling import SamplingParams, probs_from_logits


@torch.no_grad()
def generate_plain(target: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int,
                   sampling: SamplingParams = SamplingParams(), eos_token_id: int | None = None,
                   generator: torch.Generator | None = None, grammar=None) -> list[int]:
    """Prefill, then decode one token at a time with a KV cache (batch 1, no trees involved).

    `grammar` (a `grammar.RequestGrammar`) masks each step's logits to the tokens it allows."""
    cache = target.new_cache(1, len(prompt_ids) + max_new_tokens + 1)
    ids = torch.tensor([prompt_ids])
    n = len(prompt_ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)
    hidden = target(ids, torch.arange(n).view(1, n), causal, cache, torch.zeros(1, dtype=torch.int64))
    out: list[int] = []
    while True:
        logits = target.logits(hidden[0, -1])
        if grammar is not None:
            allowed = grammar.root_mask()
            if not bool(allowed.any()):
                return out
            logits = logits.masked_fill(~allowed, float("-inf"))
        if sampling.greedy:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(probs_from_logits(logits, sampling), 1, generator=generator))
        out.append(token)
        if grammar is not None and (not grammar.advance([token]) or grammar.terminated):
            return out
        if len(out) >= max_new_tokens or token == eos_token_id:
            return out
        mask = torch.ones(1, 1, 1, n + 1, dtype=torch.bool)
        hidden = target(torch.tensor([[token]]), torch.tensor([[n]]), mask, cache, torch.tensor([n]))
        n += 1
