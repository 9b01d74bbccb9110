"""The reference tree-speculative engine (pure torch; CPU or GPU).

One decode step for a batch, each request with its own tree:

    draft   : drafter.begin(f_{n-1}, root) -> the policy chooses a tree -> drafter.expand(tree)
    verify  : one target pass over all tree nodes with the tree attention mask
    accept  : greedy (longest path matching the target's argmax) or recursive rejection sampling
    commit  : move the accepted nodes' KV into place (compaction); root <- the target's next token
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model.llama import LlamaForCausalLM
from ..tree import Tree
from .batch_tree import pad_trees, tree_attention_mask
from .draft import DraftState, make_drafting
from .sampling import SamplingParams, entropy_nats, probs_from_logits
from .verify import Accepted, verify_greedy, verify_sampling


class RequestError(ValueError):
    """A request that cannot be served as asked (empty prompt, too long, ...)."""


@dataclass
class StepRecord:
    tree: str
    num_nodes: int
    accepted: int  # drafted tokens accepted (0 .. depth)
    target_entropy: list[float]  # target entropy (nats) at each accepted position, root first
    draft_entropy: float  # the drafter's entropy for the first drafted position
    seconds: float  # wall time of the whole batch step


@dataclass
class RequestResult:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    finish_reason: str = ""

    @property
    def mean_accepted(self) -> float:
        return sum(s.accepted for s in self.steps) / max(1, len(self.steps))

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per target forward pass (prefill counts as one)."""
        return len(self.output_ids) / (1 + len(self.steps))


@dataclass(frozen=True)
class StepView:
    """What a tree chooser sees for one request at one step (read-only)."""

    index: int  # request index in the batch
    draft_entropy: float  # drafter entropy for the next position, before the tree is chosen
    history: tuple[StepRecord, ...]
    batch_size: int
    position: int  # tokens committed so far


TreeChooser = Callable[[StepView], Tree]


def static_chooser(tree: Tree) -> TreeChooser:
    return lambda view: tree


class Engine:
    def __init__(self, target: LlamaForCausalLM, drafter_kind: str, drafter: torch.nn.Module,
                 eos_token_id: int | None = None):
        self.target = target
        self.drafter_kind = drafter_kind
        self.drafter = drafter
        self.eos = eos_token_id
        self.context = target.shape.max_position_embeddings

    # ------------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if len(prompt_ids) == 0:
            raise RequestError("empty prompt: give at least one token of input")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) + max_new_tokens > self.context:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model context of {self.context} tokens")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, chooser: TreeChooser,
                 sampling: SamplingParams = SamplingParams(), seed: int = 0,
                 observer: Callable | None = None) -> list[RequestResult]:
        """Generate for a batch. `chooser` picks each request's tree per step. `observer(state, lens,
        drafting, active)`, if given, sees the drafter state of every step before the tree is chosen."""
        for p in prompts:
            self.check_request(p, max_new_tokens)
        gen = torch.Generator().manual_seed(seed)
        b = len(prompts)
        results = [RequestResult(list(p)) for p in prompts]
        drafting = make_drafting(self.drafter_kind, self.drafter, self.target)
        max_nodes_guess = 64
        capacity = max(len(p) for p in prompts) + max_new_tokens + max_nodes_guess + 2
        cache = self.target.new_cache(b, capacity)

        # prefill (right-padded prompts, causal within each row)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        length = int(lens.max())
        ids = torch.zeros((b, length), dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        pos = torch.arange(length).expand(b, length)
        causal = torch.ones(length, length, dtype=torch.bool).tril().expand(b, 1, length, length)
        hidden = self.target(ids, pos, causal, cache, torch.zeros(b, dtype=torch.int64))
        last = hidden[torch.arange(b), lens - 1]  # (B, d) = f_{L-1}
        roots = self._pick(self.target.logits(last), sampling, gen)
        if self.drafter_kind == "eagle":
            drafting.prefill(ids, lens, hidden, capacity)
        for r, t in zip(results, roots.tolist()):
            r.output_ids.append(t)
        active = [not self._finished(r, max_new_tokens) for r in results]
        feats = last

        while any(active):
            t0 = time.perf_counter()
            state = drafting.begin(feats, roots)
            if observer is not None:
                observer(state, lens, drafting, active)
            d_ent = entropy_nats(state.root_logits)
            trees = []
            for i in range(b):
                tree = Tree.chain(0)
                if active[i]:
                    view = StepView(i, float(d_ent[i]), tuple(results[i].steps), sum(active), int(lens[i]))
                    tree = chooser(view)
                    tree.check_depth(drafting.max_depth, f"the {self.drafter_kind} drafter")
                    if int(lens[i]) + tree.max_depth + 1 > self.context:
                        tree = Tree.chain(0)  # no room left to speculate: plain decoding
                trees.append(tree)
            accepted, hidden, logits = self._draft_verify(drafting, state, trees, lens, cache, sampling, gen)
            feats, roots, commit = self._commit(accepted, hidden, lens, cache, state, active)
            if self.drafter_kind == "eagle":
                drafting.commit(*commit)
            seconds = time.perf_counter() - t0
            for i in range(b):
                if not active[i]:
                    continue
                acc, node_tokens = accepted[i]
                ent = entropy_nats(logits[i, list(acc.nodes)]).tolist()
                new = [node_tokens[n] for n in acc.nodes[1:]] + [acc.next_token]
                r = results[i]
                r.steps.append(StepRecord(trees[i].name, trees[i].num_nodes, acc.num_accepted, ent,
                                          float(d_ent[i]), seconds))
                r.output_ids.extend(new)
                active[i] = not self._finished(r, max_new_tokens)
        return results

    # ------------------------------------------------------------------------------------------
    def _finished(self, r: RequestResult, max_new_tokens: int) -> bool:
        if self.eos is not None and self.eos in r.output_ids:
            r.output_ids = r.output_ids[: r.output_ids.index(self.eos) + 1]
            r.finish_reason = "eos"
            return True
        if len(r.output_ids) >= max_new_tokens:
            r.output_ids = r.output_ids[:max_new_tokens]
            r.finish_reason = "length"
            return True
        return False

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        if sampling.greedy:
            return logits.argmax(-1)
        return torch.multinomial(probs_from_logits(logits, sampling), 1, generator=gen).squeeze(-1)

    def _draft_verify(self, drafting, state: DraftState, trees: list[Tree], lens, cache, sampling, gen):
        padded = pad_trees(trees)
        tokens = drafting.expand(state, padded)  # (B, N)
        b, n = tokens.shape
        positions = lens.view(b, 1) + padded.depths
        mask = tree_attention_mask(lens, padded)
        hidden = self.target(tokens, positions, mask, cache, lens)  # (B, N, d)
        logits = self.target.logits(hidden)  # (B, N, V)
        accepted = []
        if sampling.greedy:
            argmax = logits.argmax(-1).tolist()
        for i, tree in enumerate(trees):
            node_tokens = tokens[i, : tree.num_nodes].tolist()
            if sampling.greedy:
                acc = verify_greedy(tree, node_tokens, argmax[i])
            else:
                probs = probs_from_logits(logits[i, : tree.num_nodes], sampling)
                acc = verify_sampling(tree, node_tokens, probs, gen)
            accepted.append((acc, node_tokens))
        return accepted, hidden, logits

    def _commit(self, accepted: list[tuple[Accepted, list[int]]], hidden, lens, cache, state, active):
        """Compact the accepted nodes' KV to contiguous slots; return next features and roots."""
        b = len(accepted)
        rows, src, dst = [], [], []
        feats = torch.empty_like(hidden[:, 0])
        roots = torch.empty(b, dtype=torch.int64)
        width = max(len(a.nodes) for a, _ in accepted)
        path_tokens = torch.zeros((b, width), dtype=torch.int64)
        path_feats = torch.zeros((b, width, hidden.shape[-1]), dtype=hidden.dtype)
        counts = torch.zeros(b, dtype=torch.int64)
        for i, (acc, node_tokens) in enumerate(accepted):
            if not active[i]:  # finished rows stay where they are
                feats[i], roots[i] = state.features[i], state.roots[i]
                continue
            base = int(lens[i])
            for j, node in enumerate(acc.nodes):
                if node != j:
                    rows.append(i)
                    src.append(base + node)
                    dst.append(base + j)
                path_tokens[i, j] = node_tokens[node]
                path_feats[i, j] = state.features[i] if j == 0 else hidden[i, acc.nodes[j - 1]]
            counts[i] = len(acc.nodes)
            feats[i] = hidden[i, acc.nodes[-1]]
            roots[i] = acc.next_token
        cache.keep(torch.tensor(rows, dtype=torch.int64), torch.tensor(src, dtype=torch.int64),
                   torch.tensor(dst, dtype=torch.int64))
        lens += counts
        return feats, roots, (path_tokens, path_feats, counts)
