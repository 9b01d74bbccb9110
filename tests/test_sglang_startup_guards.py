"""ENTMTP's start-up guards on a CUDA server, checked without a GPU (issue #27 item 1).

SGLang 0.5.23's `ServerArgs(...)` does nothing on construction; `resolve_once()` runs the whole resolution
pipeline, ENTMTP's `handle_server_args` included. The pipeline asks about the machine only through
`get_platform()`, whose facts SGLang lets a caller pin (`override_platform(...)`), so a record with
`device="cuda"` resolves here as it would on an H200 (Hopper, CUDA >= 12.3, FlashInfer installed) or on a
B200. SGLang picks its default attention backend (FA3 on Hopper) before ENTMTP's hook runs, and ENTMTP
sees that choice: either it serves under the resolved flags, or it stops with one line naming the flag
to change.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from helpers.testing import import_sglang_or_skip

import_sglang_or_skip()

from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.runtime_context import override_platform  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from entmtp_sglang.model.load import BUNDLED_MODEL  # noqa: E402
from entmtp_sglang.sglang import algorithm  # noqa: E402
from entmtp_sglang.sglang.algorithm import EntMtpStartupError, check_flags, print_startup_error  # noqa: E402
from entmtp_sglang.sglang.config import ENV_FORCE, ENV_TREE_SET  # noqa: E402
from entmtp_sglang.sglang.plugin import register  # noqa: E402
from entmtp_sglang.tree.treeset import load_tree_set, shipped_tree_set  # noqa: E402

NOT_GPU = dict(is_hip=False, is_npu=False, is_xpu=False, is_musa=False, is_mps=False, has_amx=False)
H200 = dict(NOT_GPU, is_cuda=True, is_sm90=True, is_hopper_with_cuda_12_3=True, is_sm100=False,
            is_sm100_or_sm110=False, is_sm110=False, is_sm120=False, is_blackwell=False, has_flashinfer=True,
            device_sm=90, device_capability=(9, 0))
B200 = dict(H200, is_sm90=False, is_hopper_with_cuda_12_3=False, is_sm100=True, is_sm100_or_sm110=True,
            is_blackwell=True, device_sm=100, device_capability=(10, 0))
SHIPPED = shipped_tree_set("eagle", "mixed", "entmtp-tiny")   # depth 3, top-k 2
LOGGER = "entmtp_sglang.sglang"


@pytest.fixture(autouse=True)
def _plugin(monkeypatch):
    register()
    for var in (ENV_TREE_SET, ENV_FORCE, "ENTMTP_POLICY", "ENTMTP_GRAMMAR_DRAFT"):
        monkeypatch.delenv(var, raising=False)


def resolve(platform=H200, **flags) -> ServerArgs:
    """A launch_server record for the bundled model and its EAGLE drafter, resolved as on `platform`."""
    flags = {"device": "cuda", **flags}
    sa = ServerArgs(model_path=str(BUNDLED_MODEL), speculative_algorithm="ENTMTP",
                    speculative_draft_model_path=str(BUNDLED_MODEL / "eagle"), **flags)
    with override_platform(**platform):
        sa.resolve_once()
    return sa


def refusal(platform=H200, **flags) -> str:
    with pytest.raises(EntMtpStartupError) as err:
        resolve(platform, **flags)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("ENTMTP cannot start ")
    return msg


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_default_flags_start_on_an_h200(caplog):
    """No ENTMTP-specific flag: SGLang picks FA3 and decode CUDA graphs with overlap on; ENTMTP steers each,
    with a warning, and SGLang's create_worker then accepts ENTMTP (it refused before: overlap)."""
    caplog.set_level(logging.INFO)
    sa = resolve()
    v = resolving_view(sa)
    assert ("_attention_backend_default", {"attention_backend": "fa3"}) in sa._resolved_overrides
    assert v.attention_backend == "flashinfer"
    assert v.disable_overlap_schedule is True
    assert v.speculative_draft_attention_backend == "entmtp_torch"
    assert v.cuda_graph_config.decode.backend == "disabled"
    ts = load_tree_set(SHIPPED)
    assert (v.speculative_num_steps, v.speculative_eagle_topk, v.speculative_num_draft_tokens) == (3, 2, 4)
    assert ts.max_depth == 3 and ts.max_nodes == 4
    assert v.dtype == "auto" and v.max_running_requests == 48   # float32 is for the CPU only
    said = warnings(caplog)
    assert len(said) == 4, said
    assert any(w.startswith("ENTMTP: overlap scheduling off") for w in said)
    assert any(w.startswith("ENTMTP: attention backend flashinfer instead of SGLang's default fa3 (fa3 keeps "
                            "the verify width it was built with") for w in said)
    assert any(w.startswith("ENTMTP: draft attention backend entmtp_torch (trees of depth 3") for w in said)
    assert any(w.startswith("ENTMTP: CUDA graphs off for decoding") for w in said)

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from entmtp_sglang.sglang.worker import EntMtpWorker

    assert SpeculativeAlgorithm.from_string("ENTMTP").create_worker(sa) is EntMtpWorker


def test_flags_that_already_fit_are_kept_without_a_warning(caplog):
    caplog.set_level(logging.INFO)
    v = resolving_view(resolve(attention_backend="triton", disable_overlap_schedule=True, disable_cuda_graph=True,
                               speculative_draft_attention_backend="entmtp_torch"))
    assert (v.attention_backend, v.speculative_draft_attention_backend) == ("triton", "entmtp_torch")
    assert v.disable_overlap_schedule and v.cuda_graph_config.decode.backend == "disabled"
    assert warnings(caplog) == []


def test_a_b200_default_needs_no_backend_change(caplog):
    """On Blackwell SGLang picks trtllm_mha only for a known top-k of 1; ENTMTP's top-k is not known yet when
    SGLang picks (handle_server_args runs after), so the default there is flashinfer."""
    caplog.set_level(logging.INFO)
    v = resolving_view(resolve(B200))
    assert v.attention_backend == "flashinfer" and v.page_size == 1
    assert not any("attention backend flashinfer instead" in w for w in warnings(caplog))


def test_a_b200_with_topk_one_gets_a_paged_backend_and_names_the_flag():
    """--speculative-eagle-topk 1 makes SGLang pick trtllm_mha and page size 64 on Blackwell; the shipped set
    branches, so ENTMTP stops, naming --attention-backend (--page-size 1 would be overridden again)."""
    msg = refusal(B200, speculative_eagle_topk=1)
    assert msg == ("ENTMTP cannot start with page size 64: its tree set branches (top-k 2), and ENTMTP lays "
                   "branching drafts out one token per page; pass --attention-backend flashinfer (SGLang chose "
                   "page size 64 for trtllm_mha)")


FA3_WHY = "fa3 keeps the verify width it was built with, and ENTMTP verifies a tree of a different size each step"


@pytest.mark.parametrize("flags,message", [
    ({"attention_backend": "fa3"},
     f"with --attention-backend fa3 on CUDA: {FA3_WHY}; pass --attention-backend flashinfer (or triton)"),
    ({"attention_backend": "flashinfer", "decode_attention_backend": "fa3"},
     f"with --decode-attention-backend fa3 on CUDA: {FA3_WHY}; pass --decode-attention-backend flashinfer "
     "(or triton)"),
    ({"attention_backend": "entmtp_torch"},
     "with --attention-backend entmtp_torch on CUDA: entmtp_torch reads SGLang's tree mask in its CPU layout, "
     "and on CUDA SGLang builds the full mask; pass --attention-backend flashinfer (or triton)"),
    ({"enable_dp_attention": True, "dp_size": 2, "tp_size": 2},
     "with data-parallel attention (attention DP size 2): each rank would pick its own tree and run its own "
     "number of draft passes; remove --enable-dp-attention (and --attn-dp-size)"),
    ({"page_size": 16},
     "with page size 16: its tree set branches (top-k 2), and ENTMTP lays branching drafts out one token per "
     "page; pass --page-size 1"),
    ({"speculative_draft_attention_backend": "flashinfer"},
     "with --speculative-draft-attention-backend flashinfer: its tree set has trees of depth 3, which ENTMTP "
     "drafts with entmtp_torch only; pass --speculative-draft-attention-backend entmtp_torch"),
])
def test_unsupported_combinations_stop_with_one_line(flags, message, capsys):
    msg = refusal(**flags)
    assert msg == f"ENTMTP cannot start {message}"
    # what `python -m sglang.launch_server` prints for it (the plugin installs this excepthook)
    print_startup_error(EntMtpStartupError, EntMtpStartupError(msg), None)
    assert capsys.readouterr().err == f"error: {msg}\n"


def depth_one_set(tmp_path) -> str:
    """The shipped set cut to its trees of depth <= 1 (chain:0 and b3n3d1)."""
    data = json.loads(SHIPPED.read_text())
    data["trees"] = [t for t in data["trees"] if t["name"] in ("chain:0", "b3n3d1")]
    data.pop("predictor", None)
    path = tmp_path / "depth1.json"
    path.write_text(json.dumps(data))
    assert load_tree_set(path).max_depth == 1
    return str(path)


def test_a_depth_one_set_keeps_sglangs_draft_backend(tmp_path, monkeypatch, caplog):
    """Depth <= 1: no draft-decode pass, so no draft backend is steered; an explicit flashinfer draft is fine,
    fa3 is not (the draft-extend pass also changes width with the tree)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv(ENV_TREE_SET, depth_one_set(tmp_path))
    v = resolving_view(resolve())
    assert v.speculative_draft_attention_backend is None and v.speculative_num_steps == 1
    assert not any("draft attention backend" in w for w in warnings(caplog))
    v = resolving_view(resolve(speculative_draft_attention_backend="triton"))
    assert v.speculative_draft_attention_backend == "triton"
    assert refusal(speculative_draft_attention_backend="fa3") == (
        "ENTMTP cannot start with --speculative-draft-attention-backend fa3 on CUDA: the draft pass covers a tree "
        "of a different size each step; pass --speculative-draft-attention-backend flashinfer (or triton, "
        "entmtp_torch)")


def test_the_cpu_setup_is_unchanged(caplog):
    """The CPU launch (entmtp_torch serves target and draft): nothing to steer but overlap, float32 as before."""
    caplog.set_level(logging.INFO)
    v = resolving_view(resolve(NOT_GPU, device="cpu", attention_backend="entmtp_torch", disable_cuda_graph=True))
    assert v.disable_overlap_schedule and v.dtype == "float32"
    assert v.attention_backend == "entmtp_torch" and v.speculative_draft_attention_backend is None
    assert not any("attention backend" in w or "CUDA graphs" in w for w in warnings(caplog))


def test_other_devices_are_refused():
    ts = load_tree_set(SHIPPED)
    with pytest.raises(EntMtpStartupError, match=r"^ENTMTP cannot start on --device xpu: it runs on cpu and cuda "
                                                 r"only; pass --device cuda \(or cpu\)$"):
        check_flags(SimpleNamespace(device="xpu"), ts, 2)


def test_steering_on_a_plain_object_turns_every_decode_graph_off(caplog):
    """A record without SGLang's resolved graph config (an embedding program's object): the legacy flag."""
    caplog.set_level(logging.INFO)
    args = SimpleNamespace(disable_cuda_graph=False)
    algorithm._decode_graphs_off(args)
    assert args.disable_cuda_graph is True
    assert warnings(caplog) == ["ENTMTP: CUDA graphs off (ENTMTP's tree changes shape every step); pass "
                                "--disable-cuda-graph to silence this"]


@pytest.mark.sglang
def test_a_real_launch_prints_the_one_line(tmp_path):
    """`python -m sglang.launch_server` on this CPU with a refused flag: one `error:` line, no traceback."""
    import re

    from entmtp_sglang.calibrate.server import SGLangServer

    srv = SGLangServer.cpu("ENTMTP", extra=("--page-size", "16"), log_path=tmp_path / "refused.log")
    srv.start(wait=False)
    assert srv.exit_code() != 0
    log = srv.log_text()
    assert re.search(r"^error: ENTMTP cannot start with page size 16: its tree set branches \(top-k 2\), and "
                     r"ENTMTP lays branching drafts out one token per page; pass --page-size 1$", log, re.M), log
    assert "Traceback" not in log, log
