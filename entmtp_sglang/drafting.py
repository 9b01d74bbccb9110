"""The drafting protocol and the one registry of drafter kinds.

A drafter kind is added here, in `DRAFTER_KINDS`, and nowhere else: the loader, the reference engine, tree sets,
cost tables, `entmtp model prepare` and the command line read their kinds from this table.

The protocol the reference engine drives, per batch (B requests), one decode step at a time:

    drafting = drafter_kind(name).drafting(module, target)
    drafting.prefill(prompt_ids, prompt_lens, features, capacity)   # once, after the target's prefill
    loop:
        state = drafting.begin(features, roots)                      # state.root_logits: logits over x_{n+1}
        tokens, logprobs = drafting.expand(state, trees, legal, after_level)   # every node of each tree
        ... the target verifies; each request accepts a path ...
        drafting.commit(path_tokens, path_features, counts)           # the accepted path, with its features

`features` are what the drafter reads of the target: with `target_layers` None, the target's final-normed hidden
state f_{n-1} (B, d) (Medusa, Hydra, EAGLE); else the residual stream entering those target layers,
concatenated (B, len(target_layers) * d) (EAGLE-3's low, mid and high features). The engine asks the target for
exactly that and hands it to every call. `path_logits(state, true_tokens)` (B, K) gives the drafter's logits at
depths 1..K along a known continuation (calibration and the model card). `prefill` and `commit` do nothing by
default: only a drafter that keeps per-request state (a KV cache) overrides them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


class Drafting:
    """The base of every drafter's drafting; subclasses implement `begin`, `expand`, `path_logits` and set
    `max_depth` (the deepest tree level they can draft)."""

    max_depth: int
    target_layers: tuple[int, ...] | None = None  # None: the final-normed hidden state

    def prefill(self, prompt_ids, prompt_lens, features, capacity: int) -> None:
        """prompt_ids (B, L) right-padded; features (B, L, D) of the prompt's positions. Nothing by default."""

    def begin(self, features, roots):
        """features (B, D) of position n-1, roots (B,) = x_n. Returns a `engine.draft.DraftState`."""
        raise NotImplementedError

    def expand(self, state, trees, legal=None, after_level=None):
        """Fill every node of the padded trees: (tokens (B, N), draft log-probs (B, N))."""
        raise NotImplementedError

    def path_logits(self, state, true_tokens) -> list:
        """Drafter logits at depths 1..K along true_tokens (B, K) = x_{n+1..n+K}."""
        raise NotImplementedError

    def commit(self, path_tokens, path_features, counts) -> None:
        """After verification: path_tokens (B, T) = each root and its accepted drafts, path_features (B, T, D) the
        target features of the positions before them, counts (B,) valid entries. Nothing by default."""


PROTOCOL = ("begin", "expand", "path_logits")  # what a subclass must define itself


def _resolve(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind. `module` and `drafting` name classes as "package.module:Class", imported on first use
    (so tree sets and cost tables can check a kind's name without importing torch models).

    module     the nn.Module; `Class.from_config(cfg, target_shape, draft_ids)` builds it from the drafter
               directory's config.json for a target of `target_shape`
    drafting   a `Drafting` subclass; `Class(module, target)` drafts with it
    summary    one line for help texts
    label      its name in tables and reports (default: `name`)"""

    name: str
    module: str
    drafting: str
    summary: str
    label: str = ""

    @property
    def display(self) -> str:
        return self.label or self.name

    def module_class(self):
        return _resolve(self.module)

    def drafting_class(self):
        cls = _resolve(self.drafting)
        if not issubclass(cls, Drafting):
            raise TypeError(f"{self.drafting} (drafter {self.name!r}) is not a entmtp_sglang.drafting.Drafting")
        missing = [m for m in PROTOCOL if getattr(cls, m) is getattr(Drafting, m)]
        if missing:
            raise TypeError(f"{self.drafting} (drafter {self.name!r}) does not implement {', '.join(missing)}")
        return cls

    def build_drafting(self, module, target) -> Drafting:
        return self.drafting_class()(module, target)


DRAFTER_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    if kind.name in DRAFTER_KINDS:
        raise ValueError(f"drafter {kind.name!r} is registered twice")
    DRAFTER_KINDS[kind.name] = kind
    return kind


register(DrafterKind("medusa", "entmtp_sglang.model.drafters:MedusaHeads", "entmtp_sglang.engine.draft:MedusaDrafting",
                     "K independent heads over the target's last feature"))
register(DrafterKind("hydra", "entmtp_sglang.model.drafters:HydraHead", "entmtp_sglang.engine.draft:HydraDrafting",
                     "sequentially dependent heads that also read the drafted tokens"))
register(DrafterKind("eagle", "entmtp_sglang.model.drafters:EagleDraft", "entmtp_sglang.engine.draft:EagleDrafting",
                     "one decoder layer over (token, target feature), SGLang's EAGLE layout", "EAGLE"))
register(DrafterKind("eagle3", "entmtp_sglang.model.eagle3:Eagle3Draft",
                     "entmtp_sglang.engine.draft_eagle3:Eagle3Drafting",
                     "one decoder layer over the target's fused low, mid and high features, SGLang's EAGLE-3 layout",
                     "EAGLE-3"))


def drafter_names() -> tuple[str, ...]:
    return tuple(DRAFTER_KINDS)


def drafter_kind(name: str) -> DrafterKind:
    try:
        return DRAFTER_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTER_KINDS)}") from None
