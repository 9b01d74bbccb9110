"""ENTMTP's SGLang-side settings: the tree-set resolution order, validation, the grammar switch, tree pins.

Pure Python: entmtp_sglang.sglang.config imports nothing of SGLang.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from entmtp_sglang.sglang.config import (
    ENV_GRAMMAR_DRAFT,
    ENV_TREE_SET,
    PIN_KEY,
    EntMtpConfig,
    pin_of,
    resolve_tree_set_path,
)
from entmtp_sglang.tree.treeset import TreeSetError, load_tree_set, shipped_tree_set


def args(tmp_path, adaptive=None):
    return SimpleNamespace(model_path=str(tmp_path / "entmtp-tiny") + "/", speculative_adaptive_config=adaptive)


def test_tree_set_resolution_order(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    default = shipped_tree_set("eagle", "mixed")
    assert resolve_tree_set_path(None) == default
    other = tmp_path / "set.json"
    other.write_text(json.dumps({"format": "entmtp-tree-set"}))
    assert resolve_tree_set_path(str(other)) == other
    # an SGLang adaptive config that is not a tree set is SGLang's, not ours
    sglang_cfg = tmp_path / "adaptive.json"
    sglang_cfg.write_text(json.dumps({"candidate_steps": [1, 3]}))
    assert resolve_tree_set_path(str(sglang_cfg)) == default
    monkeypatch.setenv(ENV_TREE_SET, str(tmp_path / "env.json"))
    assert resolve_tree_set_path(str(other)) == tmp_path / "env.json"


def test_a_set_calibrated_through_sglang_is_served_before_the_reference_engines(monkeypatch):
    """SmolLM2 ships both; the SGLang one (its trees and step costs timed in SGLang) is what ENTMTP serves. The
    bundled model ships only the reference engine's, which stays its default."""
    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    smol = "smollm2-135m-instruct"
    sglang_set = shipped_tree_set("eagle", "mixed", smol, engine="sglang")
    assert sglang_set.name == f"{smol}-eagle-mixed-sglang.json" and sglang_set.exists()
    assert shipped_tree_set("eagle", "mixed", smol).exists()
    assert resolve_tree_set_path(None, smol) == sglang_set
    ts = load_tree_set(sglang_set, model=smol)
    assert "SGLang" in ts.hardware and ts.provenance["step_cost_source"]
    assert any(e.tree.parents == (-1,) for e in ts.trees)
    assert not shipped_tree_set("eagle", "mixed", engine="sglang").exists()
    assert resolve_tree_set_path(None) == shipped_tree_set("eagle", "mixed")
    assert resolve_tree_set_path(None, "no-such-model") is None
    with pytest.raises(ValueError, match="engine must be one of"):
        shipped_tree_set("eagle", "mixed", smol, engine="vllm")


def test_a_missing_or_broken_adaptive_config_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    with pytest.raises(TreeSetError, match="cannot read it"):
        resolve_tree_set_path(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "entmtp-tree-set", ')
    with pytest.raises(TreeSetError, match="not valid JSON"):
        resolve_tree_set_path(str(broken))


def test_admission_checks_prompts_and_custom_params():
    from entmtp_sglang.sglang.admission import custom_params_error, prompt_error

    assert prompt_error([1, 2, 3], 100) is None
    assert "empty" in prompt_error([], 100)
    assert prompt_error([], 100, in_session=True) is None
    assert "token id 99999, outside the model's vocabulary [0, 100)" in prompt_error([5, 99999], 100)
    assert "token id -1" in prompt_error([-1], 100)
    names = lambda: ("chain:0", "b0n4d3")  # noqa: E731
    assert custom_params_error(None, names) is None
    assert custom_params_error({"other": 1, "entmtp_tree": "b0n4d3"}, names) is None
    assert "is not a tree of this server's tree set: chain:0, b0n4d3" in custom_params_error(
        {"entmtp_tree": "nope"}, names)
    assert "is not a tree" in custom_params_error({"entmtp_tree": 3}, names)
    assert "must be a JSON object" in custom_params_error("b0n4d3", names)
    assert "must be a JSON object" in custom_params_error({"a": {"b": {"c": 1}}}, names)


def test_penalised_requests_decode_plainly():
    from types import SimpleNamespace as NS

    from entmtp_sglang.sglang.worker import needs_plain_decoding, penalised

    def req(**sp):
        base = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0)
        return NS(sampling_params=NS(**{**base, **sp}), output_ids=[1, 2])

    assert not needs_plain_decoding([req(), req()])
    assert needs_plain_decoding([req(), req(frequency_penalty=0.5)])
    assert needs_plain_decoding([req(presence_penalty=-0.2)])
    assert needs_plain_decoding([req(repetition_penalty=1.2)])
    assert needs_plain_decoding([req(min_new_tokens=3)])        # 2 tokens so far: still under the minimum
    assert not needs_plain_decoding([req(min_new_tokens=2)])
    # a penalty lasts to the request's end, so its rested positions are never caught up; a minimum ends
    assert penalised(req(frequency_penalty=0.5)) and penalised(req(repetition_penalty=0.9))
    assert not penalised(req(min_new_tokens=3)) and not penalised(req()) and not penalised(NS())


def test_max_rest_comes_from_the_environment_and_is_bounded(tmp_path, monkeypatch):
    from entmtp_sglang.sglang.config import ENV_MAX_REST, MAX_REST_LIMIT, SGLANG_MAX_REST

    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    monkeypatch.delenv(ENV_MAX_REST, raising=False)
    assert EntMtpConfig.from_server_args(args(tmp_path)).max_rest == SGLANG_MAX_REST
    monkeypatch.setenv(ENV_MAX_REST, "0")   # back off step by step, never resting the drafter
    assert EntMtpConfig.from_server_args(args(tmp_path)).max_rest == 0
    for bad in ("-1", str(MAX_REST_LIMIT + 1), "lots"):
        monkeypatch.setenv(ENV_MAX_REST, bad)
        with pytest.raises(ValueError, match=ENV_MAX_REST):
            EntMtpConfig.from_server_args(args(tmp_path))


def test_config_validates_and_reads_the_grammar_switch(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    monkeypatch.delenv(ENV_GRAMMAR_DRAFT, raising=False)
    cfg = EntMtpConfig.from_server_args(args(tmp_path))
    assert cfg.model_name == "entmtp-tiny" and cfg.grammar_drafting
    assert cfg.load_tree_set().drafter == "eagle"
    monkeypatch.setenv(ENV_GRAMMAR_DRAFT, "0")
    assert not EntMtpConfig.from_server_args(args(tmp_path)).grammar_drafting
    monkeypatch.setenv(ENV_GRAMMAR_DRAFT, "maybe")
    with pytest.raises(ValueError, match=ENV_GRAMMAR_DRAFT):
        EntMtpConfig.from_server_args(args(tmp_path))
    with pytest.raises(ValueError, match="hysteresis"):
        EntMtpConfig(tree_set_path=tmp_path, model_name="m", hysteresis=1.5)
    with pytest.raises(ValueError, match="max_nodes"):
        EntMtpConfig(tree_set_path=tmp_path, model_name="m", max_nodes=0)


def test_a_tree_set_for_another_model_names_the_model(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    cfg = EntMtpConfig(tree_set_path=shipped_tree_set("eagle", "mixed"), model_name="llama-3-8b")
    with pytest.raises(TreeSetError, match="llama-3-8b"):
        cfg.load_tree_set()


def test_the_set_must_bin_on_a_draft_signal(tmp_path, monkeypatch):
    """The worker computes draft signals only; a target-entropy set fails at start-up, naming the signal."""
    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    data = json.loads(shipped_tree_set("eagle", "mixed").read_text())
    for signal, ok in (("draft_margin", True), ("target_window", False)):
        path = tmp_path / f"{signal}.json"
        path.write_text(json.dumps({**data, "signal": signal}))
        cfg = EntMtpConfig(tree_set_path=path, model_name="entmtp-tiny")
        if ok:
            assert cfg.load_tree_set().signal == signal
        else:
            with pytest.raises(TreeSetError, match="signal 'target_window'.*draft_entropy"):
                cfg.load_tree_set()


def test_pin_of_reads_the_request_custom_params():
    assert pin_of({PIN_KEY: "b0n4d3"}) == "b0n4d3"
    assert pin_of({PIN_KEY: 3}) == "3"
    assert pin_of({}) is None and pin_of(None) is None and pin_of("chain:0") is None


def test_policy_setting_is_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_POLICY", "entmtp-bins")
    assert EntMtpConfig.from_server_args(args(tmp_path)).policy == "entmtp-bins"
    monkeypatch.setenv("ENTMTP_POLICY", "oracle")
    with pytest.raises(ValueError, match="ENTMTP_POLICY='oracle': takes one of entmtp, "):
        EntMtpConfig.from_server_args(args(tmp_path))
