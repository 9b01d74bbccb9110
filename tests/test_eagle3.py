"""The EAGLE-3 drafter (model/eagle3.py), its drafting (engine/draft_eagle3.py) and its training
(training/eagle3_train.py): training-time test computes what drafting computes, the SGLang export loads back, and a
short training run on the bundled model's fixed-data shards learns, resumes and exports."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from entmtp_sglang.drafting import drafter_kind
from entmtp_sglang.model.eagle3 import Eagle3Draft, export
from entmtp_sglang.model.llama import LlamaForCausalLM, LlamaShape, init_weights
from entmtp_sglang.model.load import BUNDLED_MODEL, load_drafter, load_target
from entmtp_sglang.model.prepare import add_head_from_target
from entmtp_sglang.training import eagle3_train as et
from entmtp_sglang.training import fixed_data as fd

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LAYERS = (1, 2, 3)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaShape(**TINY))
    init_weights(target, std=0.3)
    draft = Eagle3Draft(LlamaShape(**{**TINY, "num_hidden_layers": 1}), torch.arange(0, 97, 3), LAYERS)
    init_weights(draft, std=0.3)
    draft.target_shared({})
    draft.share_target(target)
    for m in (target, draft):
        m.eval().requires_grad_(False)
    return target, draft


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_training_time_test_computes_what_drafting_computes(models, kind):
    """Level k of training-time test at position L+k equals the drafter's k-th chain step after a prompt of L
    tokens (prefill, begin, then drafting along the true tokens)."""
    target, draft = models
    seq = torch.randint(0, 97, (1, 24))
    last, aux = target(seq, capture=LAYERS)  # (1, 24, 3d): the residual streams entering layers 1, 2, 3
    if kind == "eagle":
        from entmtp_sglang.model.drafters import EagleDraft

        torch.manual_seed(2)
        draft = EagleDraft(LlamaShape(**{**TINY, "num_hidden_layers": 1}), torch.arange(0, 97, 3))
        init_weights(draft, std=0.1)  # no final norm: larger weights make logits in the thousands
        draft.share_target(target)
        draft.eval().requires_grad_(False)
        aux = last  # EAGLE reads the target's final-normed feature
    steps = 4
    # training-time test over the window of entries p = 1 .. 23 (entry p: token x_p, features of p-1)
    outs = et.ttt_forward(draft, seq[:, 1:], torch.arange(1, 24).view(1, -1), aux[:, :-1],
                          torch.ones(1, 23, dtype=torch.bool), steps)
    drafting = drafter_kind(kind).build_drafting(draft, target)
    assert drafting.target_layers == (LAYERS if kind == "eagle3" else None)
    for length in (3, 9, 17):
        drafting.prefill(seq[:, :length], torch.tensor([length]), aux[:, :length], 64)
        state = drafting.begin(aux[:, length - 1], seq[:, length])
        chain = drafting.path_logits(state, seq[:, length + 1: length + 1 + steps])
        for k in range(steps):
            want = drafting.logits(outs[k][0, length + k - 1])
            assert torch.allclose(chain[k][0], want, atol=1e-4, rtol=1e-4), (length, k)
            assert bool(torch.isinf(chain[k][0, 1]))  # token 1 is outside the draft vocabulary


def test_export_is_sglang_layout_and_loads_back(models, tmp_path):
    target, draft = models
    model_dir = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model_dir, ignore=shutil.ignore_patterns("medusa", "hydra", "eagle", "eagle3"))
    tiny = load_target(model_dir)
    torch.manual_seed(1)
    shape = LlamaShape(**{**vars(tiny.shape), "num_hidden_layers": 1})
    d = Eagle3Draft(shape, torch.arange(0, tiny.shape.vocab_size, 5), (2, 3, 3))
    init_weights(d, std=0.1)
    d.target_shared({})
    d.share_target(tiny)
    for p in d.parameters():  # what the bf16 export keeps
        p.data = p.data.to(torch.bfloat16).float()
    d.eval().requires_grad_(False)
    cfg = json.loads((model_dir / "config.json").read_text())
    export(d, model_dir / "eagle3", cfg, with_head=True)
    written = json.loads((model_dir / "eagle3" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"] and written["draft_vocab_size"] == len(d.d2t)
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # SGLang adds one
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "eagle3" / "model.safetensors"))
    assert set(state) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                         "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert state["fc.weight"].dtype == torch.bfloat16 and state["fc.weight"].shape == (256, 3 * 256)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (256, 2 * 256)
    assert torch.equal(state["d2t"] + torch.arange(len(state["d2t"])), torch.arange(0, 4096, 5))
    loaded = load_drafter(model_dir, "eagle3", target=tiny)
    assert loaded.target_layers == (2, 3, 3)
    x = torch.randn(2, 3, 3 * 256)
    tok = torch.randint(0, 4096, (2, 3))
    pos = torch.arange(3).expand(2, 3)
    assert torch.allclose(loaded.logits(loaded(tok, x, pos)), d.logits(d(tok, x, pos)), atol=1e-5)
    # shipped without the head: the loader and `add_head_from_target` take the target's rows
    export(d, model_dir / "eagle3", cfg, with_head=False)
    headless = load_drafter(model_dir, "eagle3", target=tiny)
    assert torch.allclose(headless.logits(headless(tok, x, pos)), d.logits(d(tok, x, pos)), atol=1e-5)
    head = tiny.lm_head_weight
    assert add_head_from_target(model_dir / "eagle3", head) and not add_head_from_target(model_dir / "eagle3", head)
    assert "lm_head.weight" in load_file(str(model_dir / "eagle3" / "model.safetensors"))


WORDS = "alpha beta gamma delta return value import class def json key list print open file data".split()


def _documents(source: str, rng: random.Random):
    def words(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))
    for _ in range(200):
        if source == "code-files":
            yield fd.Doc(source, text="\n".join(words(rng.randint(3, 9)) for _ in range(rng.randint(3, 30))))
        else:
            yield fd.Doc(source, (("user", words(rng.randint(2, 12))), ("assistant", words(rng.randint(2, 40)))))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    recipe = fd.Recipe(positions=1500, shard_positions=500, max_tokens=96, batch_tokens=512, top_k=8, corpus="test")
    return fd.build(BUNDLED_MODEL, recipe, tmp_path_factory.mktemp("fixed"), documents=_documents,
                    self_distilled=[], echo=None)


def test_windows_cover_every_entry_once():
    ws = et.windows([5, 1, 12], [0, 1, 2], 0, 4)
    covered = [w.start + i for w in ws for i in range(w.length)]
    assert covered == [1, 2, 3, 4] + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    assert [w.position for w in ws] == [1, 1, 5, 9] and [w.source for w in ws] == [0, 2, 2, 2]


def test_a_short_run_learns_resumes_and_exports(shards, tmp_path):
    cfg = et.TrainConfig(steps=3, window=48, batch_tokens=384, lr=3e-3, warmup=0.05, draft_vocab=512, minutes=30,
                         positions=4000, eval_windows=8)
    run = tmp_path / "run"
    first = et.train(shards, BUNDLED_MODEL, run, cfg, echo=False, max_batches=2)
    assert (run / "ckpt.pt").exists() and first["positions"] > 0
    done = et.train(shards, BUNDLED_MODEL, run, cfg, echo=False)  # resumes, runs to 4000 positions
    log = (run / "train.log").read_text()
    assert f"resumed at {first['positions']} positions" in log
    assert done["positions"] >= 4000 and done["positions"] < 4000 + 384
    assert any("positions/s" in ln and "ETA" in ln for ln in log.splitlines())
    held = done["held_out"]
    assert len(held["agreement"]) == 3 and held["rows"][0] > 0
    assert held["loss"][0] < first["held_out"]["loss"][0] - 0.3  # it learned
    assert held["agreement"][0] > 0.25  # random-word text: the next word is often predictable
    cfg_json = json.loads((run / "sglang" / "config.json").read_text())
    assert cfg_json["architectures"] == ["LlamaForCausalLMEagle3"] and cfg_json["draft_vocab_size"] == 512
    target = load_target(BUNDLED_MODEL)
    model_dir = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model_dir, ignore=shutil.ignore_patterns("medusa", "hydra", "eagle", "eagle3"))
    shutil.copytree(run / "shipped", model_dir / "eagle3")
    loaded = load_drafter(model_dir, "eagle3", target=target)
    assert loaded.target_layers == (1, 3, 5)  # fixed_data's capture for 6 layers (SGLang's [2, 3, 3] repeats one)


def test_a_fine_tune_starts_from_another_runs_weights(shards, tmp_path):
    cfg = et.TrainConfig(steps=2, window=48, batch_tokens=384, lr=3e-3, draft_vocab=512, positions=2500,
                         eval_windows=8)
    base = et.train(shards, BUNDLED_MODEL, tmp_path / "base", cfg, echo=False)
    fresh = et.train(shards, BUNDLED_MODEL, tmp_path / "fresh", cfg, echo=False, max_batches=1)
    tuned = et.train(shards, BUNDLED_MODEL, tmp_path / "tuned", cfg, echo=False, max_batches=1,
                     init_from=tmp_path / "base")
    assert "starting from" in (tmp_path / "tuned" / "train.log").read_text()
    assert tuned["init_from"] == str(tmp_path / "base") and fresh["init_from"] is None
    # one batch from the trained weights is far better than one batch from scratch
    assert tuned["held_out"]["loss"][0] < fresh["held_out"]["loss"][0] - 0.3
    assert abs(tuned["held_out"]["loss"][0] - base["held_out"]["loss"][0]) < 0.5
    start = torch.load(tmp_path / "base" / "ckpt.pt", weights_only=False)["draft_ids"]
    assert torch.equal(torch.load(tmp_path / "tuned" / "ckpt.pt", weights_only=False)["draft_ids"], start)
    with pytest.raises(ValueError, match="eagle3 drafter"):
        et.train(shards, BUNDLED_MODEL, tmp_path / "other", et.TrainConfig(**{**et.asdict(cfg), "kind": "eagle"}),
                 echo=False, max_batches=1, init_from=tmp_path / "base")


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_a_fine_tune_starts_from_a_shipped_drafter(shards, tmp_path, kind):
    """`--init` also takes a drafter as shipped (its bf16 checkpoint, no optimizer): the run starts from exactly those
    weights, and `score` (own_refresh's) scores them on the same held-out windows as a run's own evaluation."""
    from entmtp_sglang.training import own_refresh

    cfg = et.TrainConfig(steps=2, window=48, batch_tokens=384, lr=3e-3, draft_vocab=512, positions=2500,
                         eval_windows=8, kind=kind)
    base = et.train(shards, BUNDLED_MODEL, tmp_path / "base", cfg, echo=False)
    shipped = tmp_path / "base" / "shipped"
    again = et.train(shards, BUNDLED_MODEL, tmp_path / "again", cfg, echo=False, max_batches=0, init_from=shipped)
    assert abs(again["held_out"]["loss"][0] - base["held_out"]["loss"][0]) < 0.05  # bf16 rounding apart
    ids = torch.load(tmp_path / "base" / "ckpt.pt", weights_only=False)["draft_ids"]
    assert torch.equal(torch.load(tmp_path / "again" / "ckpt.pt", weights_only=False)["draft_ids"], ids)
    held = et.split(et.shard_files(shards))[1]
    assert et.score(shipped, BUNDLED_MODEL, held, cfg) == again["held_out"]
    tuned = et.train(shards, BUNDLED_MODEL, tmp_path / "tuned", cfg, echo=False, max_batches=3, init_from=shipped)
    assert tuned["positions"] > 0 and "starting from" in (tmp_path / "tuned" / "train.log").read_text()
    # installing keeps the drafter's record and adds the refresh's
    out = tmp_path / "installed"
    shutil.copytree(shipped, out)
    (out / "training.json").write_text(json.dumps({"kind": kind}))
    assert own_refresh.install(tmp_path / "tuned", out, {"positions": tuned["positions"]}) > 0
    record = json.loads((out / "training.json").read_text())
    assert record["kind"] == kind and record["refreshes"] == [{"positions": tuned["positions"]}]
    assert not out.with_name("installed.tmp").exists()


def test_a_fine_tune_refuses_a_folder_that_holds_no_drafter(shards, tmp_path):
    cfg = et.TrainConfig(steps=2, window=48, batch_tokens=384, draft_vocab=512, positions=500, eval_windows=8)
    with pytest.raises(FileNotFoundError, match="neither a training run"):
        et.train(shards, BUNDLED_MODEL, tmp_path / "run", cfg, echo=False, init_from=tmp_path)
    (tmp_path / "medusa").mkdir()
    shutil.copy(BUNDLED_MODEL / "medusa" / "config.json", tmp_path / "medusa")
    shutil.copy(BUNDLED_MODEL / "medusa" / "model.safetensors", tmp_path / "medusa")
    with pytest.raises(ValueError, match="starts from an EAGLE-3 drafter or an EAGLE drafter"):
        et.train(shards, BUNDLED_MODEL, tmp_path / "run2", cfg, echo=False, init_from=tmp_path / "medusa")


def test_own_refresh_installs_only_a_drafter_that_improved():
    from entmtp_sglang.training.own_refresh import better

    assert better({"agreement": [0.5, 0.4, 0.3]}, {"agreement": [0.48, 0.41, 0.3]})
    assert not better({"agreement": [0.5, 0.3, 0.2]}, {"agreement": [0.48, 0.41, 0.3]})  # depth 1 up, the rest down
    assert not better({"agreement": [0.47, 0.5, 0.5]}, {"agreement": [0.48, 0.41, 0.3]})


def test_the_model_card_keeps_the_drafters_it_did_not_measure_again():
    from entmtp_sglang.training.model_card import merge_previous, refresh_lines

    meta = {"model": "m", "prompts": 6, "max_new_tokens": 64, "command": "new", "duration_s": 5, "date": "d2"}
    old = {"meta": {**meta, "command": "old", "duration_s": 9, "date": "d1"},
           "results": {"medusa": {"x": 1}, "eagle": {"x": 2}}}
    results, merged = merge_previous({"eagle": {"x": 3}}, meta, old)
    assert results == {"medusa": {"x": 1}, "eagle": {"x": 3}}
    assert merged["earlier"] == {"medusa": {"command": "old", "duration_s": 9, "date": "d1"}}
    again, meta2 = merge_previous({"hydra": {"x": 4}}, {**meta, "date": "d3"}, {"meta": merged, "results": results})
    assert meta2["earlier"]["medusa"]["date"] == "d1" and meta2["earlier"]["eagle"]["date"] == "d2"
    # another prompt count: nothing is kept
    assert merge_previous({"eagle": {}}, {**meta, "prompts": 3}, old) == ({"eagle": {}}, {**meta, "prompts": 3})
    assert merge_previous({"eagle": {}}, meta, None) == ({"eagle": {}}, meta)
    record = {"date": "d", "command": "own_refresh", "positions": 1000, "seconds": 120,
              "data": {"batches_answered": 80, "seed": 3, "supervised": 500, "positions": 900},
              "held_out_before": {"agreement": [0.5, 0.4, 0.3]}, "held_out": {"agreement": [0.52, 0.43, 0.31]}}
    lines = refresh_lines({"eagle": [record]})
    assert lines[0].startswith("## ") and "0.500 / 0.400 / 0.300 -> 0.520 / 0.430 / 0.310" in lines[2]
    assert refresh_lines({}) == []


def test_the_eagle_drafter_trains_on_the_same_shards(shards, tmp_path):
    from entmtp_sglang.model.drafters import EagleDraft

    cfg = et.TrainConfig(steps=2, window=48, batch_tokens=384, lr=3e-3, draft_vocab=512, positions=2500, eval_windows=8,
                         kind="eagle")
    run = tmp_path / "run"
    first = et.train(shards, BUNDLED_MODEL, run, cfg, echo=False, max_batches=1)
    done = et.train(shards, BUNDLED_MODEL, run, cfg, echo=False)
    assert done["held_out"]["loss"][0] < first["held_out"]["loss"][0] - 0.3
    model_dir = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model_dir, ignore=shutil.ignore_patterns("medusa", "hydra", "eagle", "eagle3"))
    shutil.copytree(run / "shipped", model_dir / "eagle")
    loaded = load_drafter(model_dir, "eagle", target=load_target(BUNDLED_MODEL))
    assert isinstance(loaded, EagleDraft) and loaded.head.draft_ids.numel() == 512


def test_prepare_installs_a_headless_eagle3_with_the_targets_head(tmp_path, monkeypatch):
    """A shipped EAGLE-3 drafter without its head (trained frozen) is installed with the target's rows of its draft
    vocabulary written in, so SGLang loads the directory as it is; a second prepare leaves it alone."""
    from safetensors.torch import load_file

    from entmtp_sglang.model import prepare as prep

    shipped, model_dir = tmp_path / "shipped", tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model_dir, ignore=shutil.ignore_patterns("medusa", "hydra", "eagle", "eagle3"))
    target = load_target(model_dir)
    d = Eagle3Draft(LlamaShape(**{**vars(target.shape), "num_hidden_layers": 1}), torch.arange(7, 4096, 9), (2, 3, 3))
    export(d, shipped / "eagle3", json.loads((model_dir / "config.json").read_text()), with_head=False)
    monkeypatch.setattr(prep, "shipped_drafters", lambda spec: shipped)
    said = []
    prep._install_drafters(None, model_dir, said.append)
    state = load_file(str(model_dir / "eagle3" / "model.safetensors"))
    want = target.lm_head_weight[torch.arange(7, 4096, 9)].to(torch.bfloat16)
    assert torch.equal(state["lm_head.weight"], want) and len(said) == 2
    prep._install_drafters(None, model_dir, said.append)
    assert len(said) == 2


# -- the bundled model's EAGLE-3 drafter (training/tiny_eagle3.py) and how ENTMTP serves a draft of that kind ------

SHIPPED = BUNDLED_MODEL / "eagle3"


def test_capture_layers_are_three_distinct_layers():
    """SGLang's default [2, L//2, L-3] where those are distinct (SmolLM2's 30 layers: 2, 15, 27); else [1, L//2, L-1]
    (SGLang captures a repeated layer once, and fc would get two features for three); the model agrees."""
    from entmtp_sglang.model.eagle3 import default_target_layers

    for n in range(4, 41):
        low, mid, high = fd.eagle3_layers(n)
        assert 0 < low < mid < high < n and default_target_layers(n) == (low, mid, high), n
    assert fd.eagle3_layers(30) == (2, 15, 27) and fd.eagle3_layers(6) == (1, 3, 5)


def test_the_shipped_drafter_is_in_sglangs_eagle3_layout():
    """What SGLang's `LlamaForCausalLMEagle3.load_weights` reads: the legacy `midlayer.*` names, a head over the
    draft vocabulary (SGLang shares the target's head only with a full-vocabulary draft), d2t as target - draft ids,
    the fused layers as `eagle_aux_hidden_state_layer_ids` (SGLang captures id + 1)."""
    from safetensors.torch import load_file

    cfg = json.loads((SHIPPED / "config.json").read_text())
    target_cfg = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == target_cfg["hidden_size"]
    assert cfg["vocab_size"] == target_cfg["vocab_size"] and cfg["tie_word_embeddings"] is False
    state = load_file(str(SHIPPED / "model.safetensors"))
    vd, d = cfg["draft_vocab_size"], cfg["hidden_size"]
    assert state["lm_head.weight"].shape == (vd, d) and state["fc.weight"].shape == (d, 3 * d)
    assert all(v.dtype == torch.bfloat16 for k, v in state.items() if k not in ("d2t", "t2d"))
    ids = state["d2t"] + torch.arange(vd)
    assert bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < cfg["vocab_size"]
    assert torch.equal(state["t2d"].nonzero().flatten(), ids)
    assert "embed_tokens.weight" not in state   # SGLang and the loader share the target's
    recipe = json.loads((SHIPPED / "training.json").read_text())
    assert recipe["capture_layers"] == [1, 3, 5] and recipe["held_out"]["agreement"][0] > 0.25


def test_the_shipped_drafter_equals_plain_and_is_accepted_in_the_reference_engine():
    """Greedy speculation with the shipped drafter equals plain decoding at batch 10 and batch 1, and a trained
    drafter is accepted: 0.68 drafted tokens per chain:3 step when written (a random one: about none; the bundled
    EAGLE drafter, trained on 14x the positions of the target's own training text: 1.65)."""
    from entmtp_sglang.engine.engine import Engine, static_chooser
    from entmtp_sglang.engine.plain import generate_plain
    from entmtp_sglang.model.load import load_bundle
    from entmtp_sglang.tasks import load_prompts
    from entmtp_sglang.tree import Tree, from_sglang

    b = load_bundle(drafter="eagle3")
    assert b.drafter.target_layers == (1, 3, 5)
    prompts = [b.tokenizer.encode(it["prompt"]).ids[-200:] for task in ("code", "json", "prose", "chat", "math")
               for it in load_prompts(task, "test", 2)]
    ref = [generate_plain(b.target, p, 32, eos_token_id=b.eos_token_id) for p in prompts]
    engine = Engine(b.target, "eagle3", b.drafter, b.eos_token_id)
    for tree in (Tree.chain(3), from_sglang(3, 4, 10)):
        out = engine.generate(prompts, 32, static_chooser(tree))
        assert [r.output_ids for r in out] == ref, tree.name
        if tree.name == Tree.chain(3).name:
            steps = [s for r in out for s in r.steps]
            assert sum(s.accepted for s in steps) / len(steps) > 0.4, tree.name
    assert engine.generate(prompts[:1], 32, static_chooser(Tree.chain(4)))[0].output_ids == ref[0]


def test_entmtp_serves_a_draft_by_its_kind(tmp_path, monkeypatch):
    """The draft's kind comes from its checkpoint; an EAGLE-3 draft takes its own shipped set where there is one,
    else the model's EAGLE set, and a set calibrated for EAGLE-3 never serves an EAGLE draft."""
    from types import SimpleNamespace

    from entmtp_sglang.sglang.config import ENV_TREE_SET, EntMtpConfig, resolve_tree_set_path
    from entmtp_sglang.sglang.eagle3 import draft_kind
    from entmtp_sglang.tree.treeset import TreeSetError, shipped_tree_set

    monkeypatch.delenv(ENV_TREE_SET, raising=False)
    assert draft_kind(SHIPPED) == "eagle3" and draft_kind(BUNDLED_MODEL / "eagle") == "eagle"
    assert draft_kind(None) == "eagle" and draft_kind(tmp_path / "nothing") == "eagle"
    eagle_set = shipped_tree_set("eagle", "mixed")
    assert resolve_tree_set_path(None, "entmtp-tiny", "eagle3") == eagle_set
    args = SimpleNamespace(model_path=str(BUNDLED_MODEL), speculative_adaptive_config=None,
                           speculative_draft_model_path=str(SHIPPED))
    cfg = EntMtpConfig.from_server_args(args)
    assert cfg.drafter == "eagle3" and cfg.load_tree_set().drafter == "eagle"
    own = json.loads(eagle_set.read_text())
    own["drafter"] = "eagle3"
    (tmp_path / "eagle3.json").write_text(json.dumps(own))
    monkeypatch.setenv(ENV_TREE_SET, str(tmp_path / "eagle3.json"))
    assert EntMtpConfig.from_server_args(args).load_tree_set().drafter == "eagle3"
    plain_eagle = SimpleNamespace(**{**vars(args), "speculative_draft_model_path": str(BUNDLED_MODEL / "eagle")})
    with pytest.raises(TreeSetError, match="calibrated for the eagle3 drafter, not eagle"):
        EntMtpConfig.from_server_args(plain_eagle).load_tree_set()


def test_the_bundled_eagle_drafter_stores_no_embedding():
    """The bundled EAGLE drafter's embedding is the target's (frozen in training; 2 MB the package does not carry):
    SGLang gives the draft the target's (`set_embed_and_head`), and the loader shares it the same way."""
    from safetensors import safe_open

    with safe_open(str(BUNDLED_MODEL / "eagle" / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in set(f.keys())
    target = load_target(BUNDLED_MODEL)
    draft = load_drafter(BUNDLED_MODEL, "eagle", target=target)
    assert torch.equal(draft.embed_tokens.weight, target.model.embed_tokens.weight)


def test_the_recipe_records_a_fine_tune_on_the_targets_own_answers(tmp_path):
    from entmtp_sglang.training import smollm2_drafters as sd

    data = tmp_path / "data"
    data.mkdir()
    keys = ("recipe", "recipe_hash", "positions", "loss_mask_positions", "positions_by_source", "bytes",
            "compute_seconds", "positions_per_second", "cpu", "torch")
    (data / "summary.json").write_text(json.dumps({k: 1 for k in keys}))
    runs = {}
    for name, positions, agree in (("fixed", 2_000_000, [0.35]), ("own", 400_000, [0.45])):
        d = runs[name] = tmp_path / name
        (d / "shipped").mkdir(parents=True)
        (d / "shipped" / "model.safetensors").write_bytes(b"w" * 100)
        (d / "summary.json").write_text(json.dumps({
            "config": {"lr": 6e-4 if name == "fixed" else 2e-4}, "positions": positions, "seconds": 60.0,
            "capture_layers": [2, 15, 27], "draft_vocab": 8192, "held_out_shards": [name],
            "held_out": {"agreement": agree}}))
    out = tmp_path / "installed"
    plain = sd.install(runs["fixed"], "eagle3", data, out)
    assert plain["positions"] == 2_000_000 and plain["self_distilled"].startswith("none")
    rec = sd.install(runs["own"], "eagle3", data, out,
                     {"prompts": 1000, "supervised": 90_000, "init_from": str(runs["fixed"])})
    # the fixed-data run's own figures stay at the top; the fine-tune's are under self_distilled
    assert rec["positions"] == 2_000_000 and rec["held_out"]["agreement"] == [0.35]
    tuned = rec["self_distilled"]
    assert tuned["prompts"] == 1000 and tuned["positions"] == 400_000 and tuned["held_out"]["agreement"] == [0.45]
    assert tuned["config"]["lr"] == 2e-4 and tuned["init_from"] == str(runs["fixed"])
    assert json.loads((out / "training.json").read_text()) == rec and rec["shipped_bytes"] == 100
