"""entmtp-sglang: choose, step by step, how deep to speculate with a multi-token-prediction drafter.

The small public entry (imported lazily, so `import entmtp_sglang` stays cheap for SGLang's plugin loader):

    from entmtp_sglang import Engine, load_bundle, load_tree_set, shipped_tree_set, entmtp_policy

    bundle = load_bundle("smollm2", "eagle")                     # target + drafter (+ tokenizer)
    ts = load_tree_set(shipped_tree_set("eagle", "code", bundle.path.name))
    engine = Engine(bundle.target, bundle.drafter_kind, bundle.drafter, bundle.eos_token_id)
    policy = entmtp_policy(ts)                                   # the default EntMTP policy
    out = engine.generate([bundle.text_ids("Write a haiku.")], 64, policy, observer=policy.observe)

Inside SGLang: `--speculative-algorithm ENTMTP` (see entmtp_sglang/sglang/).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "entmtp_sglang.engine.engine",
    "SamplingParams": "entmtp_sglang.engine.sampling",
    "load_bundle": "entmtp_sglang.model.load",
    "Tree": "entmtp_sglang.tree.topology",
    "TreeSet": "entmtp_sglang.tree.treeset",
    "load_tree_set": "entmtp_sglang.tree.treeset",
    "shipped_tree_set": "entmtp_sglang.tree.treeset",
    "EntMTPPolicy": "entmtp_sglang.policy.policies",
    "entmtp_policy": "entmtp_sglang.policy.policies",
    "TreeController": "entmtp_sglang.policy.controller",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'entmtp_sglang' has no attribute {name!r}")
