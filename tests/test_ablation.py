"""The ablation's data plumbing (training/ablation.py): equal supervised positions per arm, and the target's own
responses turned into the fixed-data shard format's sequences and loss masks. No model needed."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from entmtp_sglang.training.ablation import generated_sequences, supervised_in, take
from entmtp_sglang.training.fixed_data import SOURCES


def fake_shard(path, seqs):
    """seqs: [(length, supervised positions at the end)]"""
    n = sum(ln for ln, _ in seqs)
    mask = []
    for ln, sup in seqs:
        mask += [0] * (ln - sup - 1) + [1] * sup + [0]
    save_file({"input_ids": torch.arange(n, dtype=torch.int32), "loss_mask": torch.tensor(mask, dtype=torch.uint8),
               "seq_lens": torch.tensor([ln for ln, _ in seqs], dtype=torch.int32),
               "seq_source": torch.zeros(len(seqs), dtype=torch.uint8),
               "aux_hidden_states": torch.randn(n, 6).to(torch.bfloat16),
               "hidden_states": torch.randn(n, 2).to(torch.bfloat16),
               "topk_ids": torch.zeros(n, 4, dtype=torch.int32), "topk_probs": torch.ones(n, 4, dtype=torch.float16)},
              str(path))
    return path


def test_take_stops_at_the_supervised_budget_and_cuts_the_last_sequence(tmp_path):
    a = fake_shard(tmp_path / "shard-00000.safetensors", [(10, 4), (8, 5)])
    b = fake_shard(tmp_path / "shard-00001.safetensors", [(12, 6), (6, 2)])
    got = take([a, b], 12, tmp_path / "out", {})
    assert got == {"supervised": 12, "positions": 30, "sequences": 3}
    files = sorted((tmp_path / "out").glob("shard-*.safetensors"))
    assert supervised_in(files) == 12
    second = load_file(str(files[1]))
    assert second["seq_lens"].tolist() == [12] and second["input_ids"].shape[0] == 12
    assert second["loss_mask"].tolist() == [0] * 5 + [1] * 3 + [0] * 4  # 3 of the sequence's 6 kept, in order
    assert torch.equal(second["aux_hidden_states"], load_file(str(b))["aux_hidden_states"][:12])


def test_take_refuses_a_budget_the_data_cannot_fill(tmp_path):
    a = fake_shard(tmp_path / "shard-00000.safetensors", [(10, 4)])
    try:
        take([a], 5, tmp_path / "out", {})
    except ValueError as e:
        assert "only 4 supervised positions" in str(e)
    else:
        raise AssertionError("a budget above the data was accepted")


def test_own_responses_are_supervised_from_the_last_prompt_position(tmp_path):
    (tmp_path / "gen").mkdir()
    torch.save([{"id": 0, "task": "json", "prompt": [5, 6, 7], "response": [8, 9, 2], "features": None},
                {"id": 1, "task": "chat", "prompt": [1], "response": [], "features": None}],
               tmp_path / "gen" / "shard-00000.pt")
    (ids, mask, source), = generated_sequences(tmp_path)
    assert ids == [5, 6, 7, 8, 9, 2]
    assert mask == [0, 0, 1, 1, 1, 0]  # position j is supervised when token j+1 is response text
    assert SOURCES[source] == "json-schema"
