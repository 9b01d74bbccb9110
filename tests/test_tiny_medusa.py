"""The bundled model's Medusa heads (training/tiny_medusa.py): the labels each head learns from, a short training run
on a fake shard, and the shipped heads in the shared-head form (the target's output layer, a draft vocabulary)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY
from safetensors import safe_open
from safetensors.torch import save_file

from entmtp_sglang.model.drafters import DraftVocabHead
from entmtp_sglang.model.llama import LlamaForCausalLM, LlamaShape, init_weights
from entmtp_sglang.model.load import BUNDLED_MODEL, load_drafter, load_target, target_fingerprint
from entmtp_sglang.training import tiny_medusa as tm

# Two sequences back to back, as a fixed-data shard holds them:
#
#   row        0  1  2 | 3  4  5  6
#   sequence   A  A  A | B  B  B  B
#   loss_mask  1  1  0 | 0  1  1  0      (a sequence's last row is never supervised)
#
# Head k reads the feature of row i (f_{n-1}) and learns x_{n+k}: the target's distribution at row i + k, if that row
# is in the same sequence and supervised.
SEQ_LENS = torch.tensor([3, 4], dtype=torch.int32)
LOSS_MASK = torch.tensor([1, 1, 0, 0, 1, 1, 0], dtype=torch.uint8)
EXPECTED = {
    1: [1, -1, -1, 4, 5, -1, -1],  # row 1 -> 2 unsupervised; row 2 -> 3 crosses into B
    2: [-1, -1, -1, 5, -1, -1, -1],  # row 3 -> 5; row 4 -> 6 unsupervised
    3: [-1, -1, -1, -1, -1, -1, -1],  # row 3 -> 6 unsupervised; nothing else stays in its sequence
}


@pytest.mark.parametrize("k", sorted(EXPECTED))
def test_head_k_learns_from_the_row_k_later_in_the_same_sequence(k):
    assert tm.head_label_rows(SEQ_LENS, LOSS_MASK, k).tolist() == EXPECTED[k]


def test_head_label_rows_refuses_lengths_that_do_not_cover_the_shard():
    with pytest.raises(ValueError, match="seq_lens sum to 6 rows, loss_mask has 7"):
        tm.head_label_rows(torch.tensor([3, 3]), LOSS_MASK, 1)


def _shard(path, target, seq_lens, loss_mask, seed):
    g = torch.Generator().manual_seed(seed)
    n, d = int(loss_mask.shape[0]), target.shape.hidden_size
    ids = torch.randint(0, target.shape.vocab_size, (n,), generator=g)
    with torch.no_grad():
        hidden = target.model.norm(torch.randn(n, d, generator=g))
        probs, top = torch.softmax(target.logits(hidden), -1).topk(4, dim=-1)
    save_file({"input_ids": ids.to(torch.int32), "loss_mask": loss_mask, "seq_lens": seq_lens,
               "seq_source": torch.arange(len(seq_lens), dtype=torch.uint8), "hidden_states": hidden.to(torch.bfloat16),
               "topk_ids": top.to(torch.int32), "topk_probs": probs.to(torch.float16)}, str(path))
    return path


@pytest.fixture
def tiny_target():
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaShape(**TINY))
    init_weights(target, std=0.3)
    return target.eval().requires_grad_(False)


def test_rows_of_several_shards_point_into_their_own_shard(tmp_path, tiny_target):
    files = [_shard(tmp_path / "a.safetensors", tiny_target, SEQ_LENS, LOSS_MASK, 0),
             _shard(tmp_path / "b.safetensors", tiny_target, SEQ_LENS, LOSS_MASK, 1)]
    rows = tm.load_rows(files, 3)
    assert rows.features.shape == (14, TINY["hidden_size"]) and rows.labels.shape == (3, 14)
    for k in (1, 2, 3):
        second = [j + 7 if j >= 0 else -1 for j in EXPECTED[k]]
        assert rows.labels[k - 1].tolist() == EXPECTED[k] + second
    assert rows.source.tolist() == [0, 0, 0, 1, 1, 1, 1] * 2


def test_training_moves_only_the_blocks_and_the_saved_heads_load_shared(tmp_path, tiny_target):
    lens = torch.tensor([40] * 6, dtype=torch.int32)
    mask = torch.ones(240, dtype=torch.uint8)
    mask[39::40] = 0
    rows = tm.load_rows([_shard(tmp_path / "s.safetensors", tiny_target, lens, mask, 2)], 3)
    cfg = tm.TrainConfig(heads=3, epochs=30, batch_rows=64, lr=1e-2)
    heads = tm.new_heads(tiny_target, cfg)
    assert isinstance(heads.head, DraftVocabHead) and not hasattr(heads, "lm_heads")
    assert torch.equal(heads.head.weight, tiny_target.lm_head_weight)
    assert {n for n, _ in heads.named_parameters()} == {f"blocks.{k}.linear.{w}" for k in range(3)
                                                        for w in ("weight", "bias")}
    before = tm.evaluate(heads, rows)
    run = tm.train(heads, rows, cfg, log=lambda m: None)
    after = tm.evaluate(heads, rows)
    assert run["rows"] == 6 * 38  # a sequence's last two rows have no supervised row after them
    assert after["rows"] == before["rows"] == [int((rows.labels[k] >= 0).sum()) for k in range(3)]
    assert all(a < b for a, b in zip(after["loss"], before["loss"])), (before, after)
    assert torch.equal(heads.head.weight, tiny_target.lm_head_weight)  # the target's layer is left as it was

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    tm.save(heads, model / "medusa", {"name": "tiny", "fingerprint": target_fingerprint(tiny_target)})
    cfg_file = json.loads((model / "medusa" / "config.json").read_text())
    assert cfg_file["draft_vocab_size"] == TINY["vocab_size"] and cfg_file["num_heads"] == 3
    loaded = load_drafter(model, "medusa", target=tiny_target)
    f = rows.features[:8]
    heads.requires_grad_(False)
    for k in (1, 2, 3):
        ref = heads.head_logits(f, k)
        assert torch.allclose(loaded.head_logits(f, k), tiny_target.logits(loaded.blocks[k - 1](f)))
        assert torch.allclose(loaded.head_logits(f, k), ref, atol=0.05 * float(ref.abs().max()))


def test_shipped_heads_share_the_targets_output_layer():
    d = BUNDLED_MODEL / "medusa"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["drafter"] == "medusa" and cfg["num_heads"] == 5 and cfg["draft_vocab_size"] == cfg["vocab_size"] == 4096
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
    assert names == {f"blocks.{k}.linear.{w}" for k in range(5) for w in ("weight", "bias")}
    assert (d / "model.safetensors").stat().st_size < 1e6
    target = load_target(BUNDLED_MODEL)
    heads = load_drafter(BUNDLED_MODEL, "medusa", target=target)
    assert isinstance(heads.head, DraftVocabHead) and heads.head.draft_ids.tolist() == list(range(4096))
    assert torch.equal(heads.head.weight, target.lm_head_weight)
    f = target(torch.tensor([[5, 17, 300, 9, 42]]))  # (1, T, d)
    for k in range(1, 6):  # the whole vocabulary: every logit finite, the target's head over the block's output
        logits = heads.head_logits(f, k)
        assert torch.isfinite(logits).all() and torch.allclose(logits, target.logits(heads.blocks[k - 1](f)))
    recipe = json.loads((d / "training.json").read_text())
    assert recipe["command"] == "python -m entmtp_sglang.training.tiny_medusa"
    assert len(recipe["held_out"]["agreement"]) == 5 and len(recipe["replaced"]["held_out"]["agreement"]) == 5
