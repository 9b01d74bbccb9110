"""The outside peer: Hugging Face `transformers` generation on the same bundled model (an HF
LlamaForCausalLM directory), loaded by transformers itself.

    hf-greedy          model.generate(do_sample=False): transformers' own plain decoding (the baseline)
    hf-prompt-lookup   assisted generation with prompt lookup (`prompt_lookup_num_tokens`): drafts are
                       n-gram matches copied from the context, verified by the target in one pass

transformers' assisted generation serves one request at a time, so both run at batch 1 only. There is no
small standalone assistant model to pair with the target: the bundled EAGLE drafter is a single decoder
layer that needs the target's hidden states (not a causal LM on its own), and the Medusa/Hydra heads are
not models either.
"""

from __future__ import annotations

import time

import torch

from ..model.load import BUNDLED_MODEL
from .systems import RequestOutcome, System, TaskStreams, register_system
from .workload import BenchContext

PROMPT_LOOKUP_NUM_TOKENS = 10  # transformers' documented example value
PROMPT_LOOKUP_MAX_NGRAM = 2  # transformers' default max_matching_ngram_size


class _Model:
    """The transformers model, with a counter of target passes and of the tokens each pass scored."""

    def __init__(self, ctx: BenchContext):
        from transformers import AutoModelForCausalLM

        path = ctx.model_dir or BUNDLED_MODEL
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id
        self.calls: list[int] = []
        self.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.calls.append(int(ids.shape[1]))

    @classmethod
    def of(cls, ctx: BenchContext) -> "_Model":
        return ctx.get("transformers", lambda: cls(ctx))


class HFSystem(System):
    engine = "transformers"
    baseline = "hf-greedy"

    def __init__(self, ctx: BenchContext, prompt_lookup: bool):
        self.ctx = ctx
        self.prompt_lookup = prompt_lookup
        self.hf: _Model | None = None

    def supports(self, batch_size: int) -> str | None:
        return None if batch_size == 1 else "transformers assisted generation serves batch 1 only"

    def prepare(self, streams: TaskStreams, batch_sizes: tuple[int, ...], max_new_tokens: int) -> None:
        self.hf = _Model.of(self.ctx)

    def _generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        x = torch.tensor([ids])
        kw = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS,
              "max_matching_ngram_size": PROMPT_LOOKUP_MAX_NGRAM} if self.prompt_lookup else {}
        with torch.no_grad():
            out = self.hf.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                         do_sample=False, pad_token_id=self.hf.eos, eos_token_id=self.hf.eos, **kw)
        return out[0, len(ids):].tolist()

    def run(self, streams: TaskStreams, batch_size: int, max_new_tokens: int) -> list[RequestOutcome]:
        if batch_size != 1:
            raise ValueError(self.supports(batch_size))
        if self.hf is None:
            self.hf = _Model.of(self.ctx)
        out = []
        for i, s in enumerate(streams):
            for j, seg in enumerate(s.segments):
                self.hf.calls.clear()
                t0 = time.perf_counter()
                tokens = self._generate(list(seg), max_new_tokens)
                call = time.perf_counter() - t0
                passes = self.hf.calls[1:]  # the first pass is the prefill, which yields the first token
                steps = len(passes)
                out.append(RequestOutcome(
                    stream=i, segment=j, output_ids=tokens, steps=steps,
                    accepted_drafts=max(0, len(tokens) - 1 - steps), verified_tokens=sum(passes),
                    seconds=call, call_seconds=call, trees={}, policy_seconds=None))
        return out


@register_system("hf-greedy", "transformers", "transformers model.generate, greedy (the peer's baseline)")
def _hf_greedy(ctx):
    return HFSystem(ctx, prompt_lookup=False)


@register_system("hf-prompt-lookup", "transformers",
                 f"transformers assisted generation, prompt lookup ({PROMPT_LOOKUP_NUM_TOKENS} tokens)")
def _hf_prompt_lookup(ctx):
    return HFSystem(ctx, prompt_lookup=True)
