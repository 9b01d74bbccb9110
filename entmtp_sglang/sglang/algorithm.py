"""ENTMTP registered as an SGLang speculative algorithm that joins the EAGLE code paths."""

from __future__ import annotations

import functools
import logging
import sys

from ..policy.controller import TreeController
from .config import EntMtpConfig
from .sglang_api import CustomSpecAlgo, SpeculativeAlgorithm
from .token_map import default_token_map
from .tree_plan import plan_tree, required_topk

logger = logging.getLogger("entmtp_sglang.sglang")

NAME = "ENTMTP"

# CustomSpecAlgo answers False to these; ENTMTP behaves as EAGLE does (draft KV, hidden-state capture,
# future-map relay, grammar in verify).
_AS_EAGLE = ("is_some", "is_speculative", "is_eagle", "supports_prefill_shared_read_done", "supports_mixed_chunk",
             "supports_ragged_verify", "supports_grammar_overlap", "has_draft_kv", "carries_draft_hidden_states",
             "create_future_map", "need_topk")


def draft_is_eagle3(draft_model_path: str | None) -> bool:
    """Whether the draft checkpoint is an EAGLE-3 one (an architecture named *Eagle3*, e.g.
    `LlamaForCausalLMEagle3`): it drafts from several captured target layers, over its own vocabulary."""
    return any("Eagle3" in arch for arch in _draft_architectures(draft_model_path))


@functools.lru_cache(maxsize=8)
def _draft_architectures(draft_model_path: str | None) -> tuple[str, ...]:
    if not draft_model_path:
        return ()
    from .sglang_api import get_config

    try:
        return tuple(getattr(get_config(draft_model_path, trust_remote_code=False), "architectures", None) or ())
    except Exception:   # unreadable here: SGLang's own loading reports it
        logger.debug("ENTMTP: cannot read the draft config at %s", draft_model_path, exc_info=True)
        return ()


def _served_draft_model_path() -> str | None:
    from .sglang_api import get_spec

    try:
        return get_spec().speculative_draft_model_path
    except ValueError:   # the speculative config is not published in this process (yet)
        return None


class EntMtpStartupError(ValueError):
    """ENTMTP's configuration cannot work (bad tree set, bad setting): `sglang.launch_server` prints this one
    line and exits 1 instead of a traceback (`print_startup_error`); an embedding program catches a ValueError."""


def print_startup_error(kind, value, tb, _previous=sys.excepthook) -> None:
    """sys.excepthook for the main process: one line for EntMtpStartupError, the usual report otherwise."""
    if isinstance(value, EntMtpStartupError):
        print(f"error: {value}", file=sys.stderr)
    else:
        _previous(kind, value, tb)


def checked_config(server_args):
    """(config, tree set, topk) with everything the worker would reject checked now, in the main process."""
    try:
        cfg = EntMtpConfig.from_server_args(server_args)
        ts = cfg.load_tree_set()
        topk = max(required_topk(t.tree) for t in ts.trees)
        for t in ts.trees:
            plan_tree(t.tree, topk, t.tree.max_depth)
        TreeController.for_tree_set(ts, cfg.policy != "entmtp-bins", hysteresis=cfg.hysteresis,
                                    max_nodes=cfg.max_nodes)
    except ValueError as e:  # TreeSetError, TreeShapeError, bad settings
        msg = str(e)
        raise EntMtpStartupError(msg if msg.startswith("ENTMTP") else f"ENTMTP cannot start: {msg}") from None
    return cfg, ts, topk


class EntMtpSpecAlgo(CustomSpecAlgo):
    def handle_server_args(self, server_args) -> None:
        """Sizes SGLang's EAGLE buffers for the largest tree of the set (runs on SGLang's stand-in)."""
        cfg, ts, topk = checked_config(server_args)
        steps = ts.max_depth
        server_args.speculative_num_steps = steps
        server_args.speculative_eagle_topk = topk
        server_args.speculative_num_draft_tokens = ts.max_nodes
        if str(server_args.device) == "cpu":
            server_args.disable_overlap_schedule = True
            if str(getattr(server_args, "dtype", "auto")) == "auto":
                # bfloat16 matmuls over a verify block and a one-token decode round differently, which flips
                # near-tied argmaxes: greedy output equals plain decoding in float32 (--dtype overrides)
                server_args.dtype = "float32"
                logger.info("ENTMTP on CPU: serving in float32 (pass --dtype to choose another)")
        default_token_map(server_args)
        if server_args.max_running_requests is None:
            server_args.max_running_requests = 48
        if not server_args.speculative_draft_model_path:
            raise EntMtpStartupError("ENTMTP needs a draft model: --speculative-draft-model-path DIR, an EAGLE or "
                             "EAGLE-3 draft (the bundled model's is entmtp_sglang/models/entmtp-tiny/eagle), or "
                             "the target's own directory for a model with MTP layers (NEXTN)")
        logger.info("ENTMTP: tree set %s (%d trees, up to %d nodes, depth %d, topk %d)",
                    cfg.tree_set_path or "generic (no set for this model: calibrating online)", len(ts.trees),
                    ts.max_nodes, steps, topk)

    def is_eagle3(self) -> bool:
        """As EAGLE3 when the draft checkpoint is an EAGLE-3 one (SGLang then captures the target's auxiliary
        hidden states, and maps the draft's vocabulary to the target's); as EAGLE otherwise, which also
        covers NEXTN/MTP drafts (a target's own MTP layer served as the draft model)."""
        return draft_is_eagle3(_served_draft_model_path())

    def resolve_max_speculative_num_draft_tokens(self, server_args):
        return EntMtpConfig.from_server_args(server_args).load_tree_set().max_nodes


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(SpeculativeAlgorithm.EAGLE, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"As SpeculativeAlgorithm.EAGLE.{name}."
    return method


for _name in _AS_EAGLE:
    setattr(EntMtpSpecAlgo, _name, _delegate(_name))


def _factory(server_args):
    from .worker import EntMtpWorker

    return EntMtpWorker


def register_algorithm() -> None:
    from .sglang_api import spec_registry

    if NAME in spec_registry._REGISTRY:
        return
    SpeculativeAlgorithm.register(NAME, supports_overlap=False, spec_class=EntMtpSpecAlgo)(_factory)
