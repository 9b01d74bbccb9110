"""The drafting protocol and the drafter registry (entmtp_sglang.drafting)."""

from __future__ import annotations

import pytest
import torch

from entmtp_sglang.drafting import DRAFTER_KINDS, DrafterKind, Drafting, drafter_kind, drafter_names, register
from entmtp_sglang.model.llama import LlamaForCausalLM, LlamaShape, init_weights

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("name", list(DRAFTER_KINDS))
def test_every_registered_kind_resolves_and_conforms(name):
    kind = drafter_kind(name)
    assert issubclass(kind.drafting_class(), Drafting)
    assert callable(getattr(kind.module_class(), "from_config"))


def test_the_tables_that_name_drafters_read_the_registry():
    from entmtp_sglang.calibrate import cost_table
    from entmtp_sglang.tree import treeset

    assert treeset.DRAFTERS == cost_table.DRAFTERS == drafter_names()
    assert {"medusa", "hydra", "eagle"} <= set(drafter_names())


def test_an_unknown_kind_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown drafter 'nope'; choose one of medusa, hydra, eagle"):
        drafter_kind("nope")


class _NoExpand(Drafting):
    def begin(self, features, roots):
        return None

    def path_logits(self, state, true_tokens):
        return []


def test_a_drafting_that_misses_part_of_the_protocol_is_refused():
    kind = DrafterKind("broken", "entmtp_sglang.model.drafters:MedusaHeads", f"{__name__}:_NoExpand", "")
    with pytest.raises(TypeError, match="does not implement expand"):
        kind.drafting_class()
    not_drafting = DrafterKind("broken", "entmtp_sglang.model.drafters:MedusaHeads",
                               "entmtp_sglang.model.drafters:MedusaHeads", "")
    with pytest.raises(TypeError, match="is not a entmtp_sglang.drafting.Drafting"):
        not_drafting.drafting_class()


def test_a_kind_is_registered_once():
    with pytest.raises(ValueError, match="registered twice"):
        register(DRAFTER_KINDS["eagle"])


def test_prefill_and_commit_default_to_nothing():
    class Stateless(_NoExpand):
        def expand(self, state, trees, legal=None, after_level=None):
            return None

    d = Stateless()
    assert d.prefill(None, None, None, 8) is None and d.commit(None, None, None) is None
    assert d.target_layers is None


def test_the_target_captures_the_residual_stream_entering_each_layer():
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaShape(**TINY))
    init_weights(target, std=0.3)
    ids = torch.randint(0, 97, (2, 5))
    plain = target(ids)
    normed, aux = target(ids, capture=(0, 2, 3))
    assert torch.equal(normed, plain) and aux.shape == (2, 5, 3 * 32)
    x = target.model.embed_tokens(ids)
    pos = torch.arange(5).expand(2, 5)
    entering = []
    for i, layer in enumerate(target.model.layers):
        entering.append(x)
        x = layer(x, pos, target.rotary, None, None, i, None)
    assert torch.equal(aux, torch.cat([entering[0], entering[2], entering[3]], -1))
    with pytest.raises(ValueError, match=r"capture layers \[7\]"):
        target(ids, capture=(1, 7))
