"""ENTMTP registered as an SGLang speculative algorithm that joins the EAGLE code paths."""

from __future__ import annotations

import logging
import sys

from ..policy.controller import TreeController
from .config import EntMtpConfig
from .eagle3 import EAGLE3, draft_kind
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
    return draft_kind(draft_model_path) == EAGLE3


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


# Start-up guards (issue #27). ENTMTP either runs under the flags SGLang resolved or stops with one line naming
# the flag to change; what it changes itself it logs. Target attention backends that read each step's verify
# width from the step's spec_info (FA3 keeps the width it was built with; the others are unchecked):
GPU_VERIFY_BACKENDS = ("flashinfer", "triton")
DRAFT_BACKEND = "entmtp_torch"   # the only draft backend that attends each drafted node to its own ancestors
_WHY_NOT = {
    "fa3": "fa3 keeps the verify width it was built with, and ENTMTP verifies a tree of a different size each step",
    DRAFT_BACKEND: "entmtp_torch reads SGLang's tree mask in its CPU layout, and on CUDA SGLang builds the full mask",
}


def _startup_error(msg: str) -> EntMtpStartupError:
    return EntMtpStartupError(f"ENTMTP cannot start {msg}")


def _chosen_by_sglang(server_args, field: str) -> bool:
    """Whether SGLang's resolution set `field` (a default it picked) rather than the command line: resolution
    declares its choices on the record (`_resolved_overrides`), and raw fields keep what the user passed."""
    return any(field in fields for _source, fields in getattr(server_args, "_resolved_overrides", None) or ())


def _device(server_args) -> str:
    return str(getattr(server_args, "device", None) or "cpu").split(":", 1)[0]


def check_flags(server_args, ts, topk: int) -> None:
    """Refuse the flag combinations ENTMTP cannot serve, each with one line naming the flag to change."""
    device = _device(server_args)
    if device not in ("cpu", "cuda"):
        raise _startup_error(f"on --device {device}: it runs on cpu and cuda only; pass --device cuda (or cpu)")
    dp = int(getattr(server_args, "attn_dp_size", 1) or 1)
    if dp > 1 or getattr(server_args, "enable_dp_attention", False):
        raise _startup_error(f"with data-parallel attention (attention DP size {dp}): each rank would pick its "
                             "own tree and run its own number of draft passes; remove --enable-dp-attention "
                             "(and --attn-dp-size)")
    page = int(getattr(server_args, "page_size", None) or 1)
    if page > 1 and topk > 1:
        fix = ("--page-size 1" if not _chosen_by_sglang(server_args, "page_size")
               else f"--attention-backend {GPU_VERIFY_BACKENDS[0]} (SGLang chose page size {page} for "
                    f"{server_args.attention_backend})")
        raise _startup_error(f"with page size {page}: its tree set branches (top-k {topk}), and ENTMTP lays "
                             f"branching drafts out one token per page; pass {fix}")
    if device == "cuda":
        for flag, field in (("--prefill-attention-backend", "prefill_attention_backend"),
                            ("--decode-attention-backend", "decode_attention_backend"),
                            ("--attention-backend", "attention_backend")):
            name = getattr(server_args, field, None)
            if name is None or name in GPU_VERIFY_BACKENDS:
                continue
            if field == "attention_backend" and _chosen_by_sglang(server_args, field):
                continue   # SGLang's default: steered in steer_flags
            why = _WHY_NOT.get(name, f"{name} is not checked with a verify width that changes every step")
            raise _startup_error(f"with {flag} {name} on CUDA: {why}; pass {flag} {GPU_VERIFY_BACKENDS[0]} "
                                 f"(or {GPU_VERIFY_BACKENDS[1]})")
    draft = getattr(server_args, "speculative_draft_attention_backend", None)
    depth = ts.max_depth
    if draft is not None and draft != DRAFT_BACKEND:
        if depth >= 2:
            raise _startup_error(f"with --speculative-draft-attention-backend {draft}: its tree set has trees of "
                                 f"depth {depth}, which ENTMTP drafts with {DRAFT_BACKEND} only; pass "
                                 f"--speculative-draft-attention-backend {DRAFT_BACKEND}")
        if device == "cuda" and draft not in GPU_VERIFY_BACKENDS:
            raise _startup_error(f"with --speculative-draft-attention-backend {draft} on CUDA: the draft pass "
                                 "covers a tree of a different size each step; pass "
                                 f"--speculative-draft-attention-backend {GPU_VERIFY_BACKENDS[0]} (or "
                                 f"{GPU_VERIFY_BACKENDS[1]}, {DRAFT_BACKEND})")


def steer_flags(server_args, ts) -> None:
    """Change, with a warning each, the settings SGLang defaults to that ENTMTP cannot serve under."""
    device = _device(server_args)
    if not server_args.disable_overlap_schedule:
        server_args.disable_overlap_schedule = True
        logger.warning("ENTMTP: overlap scheduling off (ENTMTP picks each step's tree on the host before drafting "
                       "it); pass --disable-overlap-schedule to silence this")
    if device == "cuda":
        name = server_args.attention_backend
        if name not in GPU_VERIFY_BACKENDS:   # check_flags let only SGLang's own default through
            from .sglang_api import get_platform

            new = GPU_VERIFY_BACKENDS[0] if get_platform().has_flashinfer else GPU_VERIFY_BACKENDS[1]
            server_args.attention_backend = new
            logger.warning("ENTMTP: attention backend %s instead of SGLang's default %s (%s); pass "
                           "--attention-backend %s to silence this", new, name,
                           _WHY_NOT.get(name, "not checked with ENTMTP"), new)
        _decode_graphs_off(server_args)
    depth = ts.max_depth
    if depth >= 2 and server_args.speculative_draft_attention_backend is None:
        inherited = server_args.decode_attention_backend or server_args.attention_backend
        if inherited != DRAFT_BACKEND:
            server_args.speculative_draft_attention_backend = DRAFT_BACKEND
            logger.warning("ENTMTP: draft attention backend %s (trees of depth %d: each drafted node attends to "
                           "its own ancestors); pass --speculative-draft-attention-backend %s to silence this",
                           DRAFT_BACKEND, depth, DRAFT_BACKEND)


def _decode_graphs_off(server_args) -> None:
    """CUDA graphs off for decoding: the draft-decode graph would capture one tree (and fails to capture:
    `entmtp_torch` has no graph state, the tree plan copies from the host), and a replayed draft-extend graph
    bypasses the logits ENTMTP reads its signal from."""
    from .sglang_api import GraphBackend, GraphPhase, with_phase

    graphs = getattr(server_args, "cuda_graph_config", None)
    if graphs is None:
        if not getattr(server_args, "disable_cuda_graph", False):
            server_args.disable_cuda_graph = True
            logger.warning("ENTMTP: CUDA graphs off (ENTMTP's tree changes shape every step); pass "
                           "--disable-cuda-graph to silence this")
        return
    if graphs.decode.backend != GraphBackend.DISABLED:
        server_args.cuda_graph_config = with_phase(graphs, GraphPhase.DECODE, backend=GraphBackend.DISABLED)
        logger.warning("ENTMTP: CUDA graphs off for decoding (ENTMTP's tree changes shape every step); pass "
                       "--disable-cuda-graph to silence this")


class EntMtpSpecAlgo(CustomSpecAlgo):
    def handle_server_args(self, server_args) -> None:
        """Checks the flags and sizes SGLang's EAGLE buffers for the largest tree of the set (runs on SGLang's
        stand-in, after SGLang has picked its attention backend and CUDA-graph settings)."""
        cfg, ts, topk = checked_config(server_args)
        if not server_args.speculative_draft_model_path:
            raise EntMtpStartupError("ENTMTP needs a draft model: --speculative-draft-model-path DIR, an EAGLE or "
                             "EAGLE-3 draft (the bundled model's is entmtp_sglang/models/entmtp-tiny/eagle), or "
                             "the target's own directory for a model with MTP layers (NEXTN)")
        check_flags(server_args, ts, topk)
        steps = ts.max_depth
        server_args.speculative_num_steps = steps
        server_args.speculative_eagle_topk = topk
        server_args.speculative_num_draft_tokens = ts.max_nodes
        steer_flags(server_args, ts)
        if _device(server_args) == "cpu" and str(getattr(server_args, "dtype", "auto")) == "auto":
            # bfloat16 matmuls over a verify block and a one-token decode round differently, which flips
            # near-tied argmaxes: greedy output equals plain decoding in float32 (--dtype overrides)
            server_args.dtype = "float32"
            logger.info("ENTMTP on CPU: serving in float32 (pass --dtype to choose another)")
        default_token_map(server_args)
        if server_args.max_running_requests is None:
            server_args.max_running_requests = 48
        logger.info("ENTMTP: %s draft, tree set %s (%d trees, up to %d nodes, depth %d, topk %d)", cfg.drafter,
                    cfg.tree_set_path or "generic (no set for this model: calibrating online)", len(ts.trees),
                    ts.max_nodes, steps, topk)
        if ts.drafter != cfg.drafter:
            logger.warning("ENTMTP: serving the %s draft with a tree set calibrated for the %s drafter (%s): the "
                           "same tree shapes, but its acceptance predictor and bins describe the other drafter; "
                           "calibrate one for this draft (`entmtp calibrate --engine sglang`)", cfg.drafter,
                           ts.drafter, cfg.tree_set_path)

    def is_eagle3(self) -> bool:
        """As EAGLE3 when the draft checkpoint is an EAGLE-3 one (SGLang then captures the target's auxiliary
        hidden states, and maps the draft's vocabulary to the target's); as EAGLE otherwise, which also
        covers NEXTN/MTP drafts (a target's own MTP layer served as the draft model)."""
        return draft_is_eagle3(_served_draft_model_path())

    def resolve_max_speculative_num_draft_tokens(self, server_args):
        """The largest tree of the set, plus the forced span a request may verify below it (forced_draft.py)."""
        from .forced_draft import extra_verify_tokens

        return EntMtpConfig.from_server_args(server_args).load_tree_set().max_nodes + extra_verify_tokens()


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
