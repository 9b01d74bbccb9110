"""Distillation prompts: a new run leaves out what earlier runs already asked (`--exclude`)."""

import json
import random

import pytest

from entmtp_sglang.training.distill_data import answered, code_prompts


def test_code_prompts_skip_what_was_asked_and_still_fill_the_count():
    first = code_prompts(40, random.Random(1))
    again = code_prompts(40, random.Random(1), skip=frozenset(first[:25]))
    assert len(again) == 40
    assert not set(again) & set(first[:25])
    assert again[:15] == first[25:]  # the same order, the asked ones taken out


def test_answered_reads_every_runs_prompts(tmp_path):
    for name, users in (("a", ["x", "y"]), ("b", ["y", "z"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "prompts.jsonl").write_text(
            "".join(json.dumps({"task": "chat", "user": u, "id": i}) + "\n" for i, u in enumerate(users)))
    assert answered([tmp_path / "a", tmp_path / "b"]) == {"x", "y", "z"}
    assert answered([]) == frozenset()


def test_answered_names_a_directory_without_prompts(tmp_path):
    with pytest.raises(FileNotFoundError, match="no prompts.jsonl"):
        answered([tmp_path])
