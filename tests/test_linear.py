"""`model.linear.linear`: linear layers through oneDNN on a packed weight (CPU, float32, no autograd), checked
against `F.linear` (its torch reference) on random inputs."""

import pytest
import torch
import torch.nn.functional as F

from entmtp_sglang.model import linear as L

needs_onednn = pytest.mark.skipif(not L._HAS_ONEDNN, reason="torch without oneDNN takes F.linear")


@pytest.mark.parametrize("out_features", [7, 192, 4099])
@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 5, 64), (16, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_within_float32_rounding(shape, out_features, bias):
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 64, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    with torch.no_grad():
        out = L.linear(x, w, b)
    assert out.shape == (*shape[:-1], out_features)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("out_features,in_features", [(576, 192), (960, 576), (576, 576), (3072, 576), (576, 1536)])
def test_a_rows_result_does_not_depend_on_the_other_rows(out_features, in_features):
    """Batch invariance: the root of a verified tree gets plain decoding's logits bit for bit (SmolLM2's
    projections; oneDNN computes one row of a 1536-wide input apart from several, hence `MIN_ROWS`)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(16, in_features, generator=g)
    with torch.no_grad():
        alone = L.linear(x[:1], w)
        for rows in (2, 3, 4, 8, 16):
            assert torch.equal(L.linear(x[:rows], w)[:1], alone), rows
        noncontiguous = L.linear(x.t().contiguous().t()[:3], w)
        assert torch.equal(noncontiguous[:1], alone)


def test_follows_in_place_weight_updates_and_keeps_autograd():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 32, generator=g)
    x = torch.randn(2, 32, generator=g)
    with torch.no_grad():
        L.linear(x, w)
        w.mul_(-2.0)  # the cached packed copy must not be reused
        torch.testing.assert_close(L.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    xg = x.clone().requires_grad_(True)
    L.linear(xg, w).sum().backward()  # with autograd on it is F.linear itself
    torch.testing.assert_close(xg.grad, w.sum(0).expand(2, -1), rtol=1e-4, atol=1e-3)


def test_other_dtypes_and_the_switch_take_f_linear(monkeypatch):
    x = torch.randn(3, 16)
    with torch.no_grad():
        wd = torch.randn(100, 16, dtype=torch.float64)
        assert torch.equal(L.linear(x.double(), wd), F.linear(x.double(), wd))
        monkeypatch.setattr(L, "ONEDNN", False)
        w = torch.randn(100, 16)
        assert torch.equal(L.linear(x, w), F.linear(x, w))


def test_the_module_keeps_nn_linears_parameters_and_state_dict_names():
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 40)
    mod = L.Linear(24, 40)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == ["weight", "bias"]
    x = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_packed_model_copies_pickles_and_follows_load_state_dict():
    import copy
    import io

    from entmtp_sglang.model.llama import LlamaForCausalLM, LlamaShape

    shape = LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(shape).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        before = model.logits(model(ids))
        twin = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        for m in (twin, loaded):
            assert torch.equal(m.logits(m(ids)), before)
        other = LlamaForCausalLM(shape).eval()
        model.load_state_dict(other.state_dict())  # in place: the packed copies must follow
        after = model.logits(model(ids))
    reference = other.logits(other(ids))  # autograd on: F.linear
    torch.testing.assert_close(after, reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)
