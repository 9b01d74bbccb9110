"""`model.llama.output_layer`: the wide output layers (LM head, draft-vocabulary heads) through oneDNN on CPU,
checked against `F.linear` (its torch reference) on random inputs."""

import pytest
import torch
import torch.nn.functional as F

from entmtp_sglang.model import llama


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 5, 64), (16, 64)])
def test_matches_f_linear_within_float32_rounding(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(llama.FAST_HEAD_MIN_OUT + 3, 64, generator=g)
    x = torch.randn(*shape, generator=g)
    with torch.no_grad():
        out = llama.output_layer(x, w)
    assert out.shape == (*shape[:-1], w.shape[0])
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_follows_in_place_weight_updates_and_keeps_autograd():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(llama.FAST_HEAD_MIN_OUT, 32, generator=g)
    x = torch.randn(2, 32, generator=g)
    with torch.no_grad():
        llama.output_layer(x, w)
        w.mul_(-2.0)  # the cached oneDNN copy must not be reused
        torch.testing.assert_close(llama.output_layer(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    xg = x.clone().requires_grad_(True)
    llama.output_layer(xg, w).sum().backward()  # with autograd on it is F.linear itself
    torch.testing.assert_close(xg.grad, w.sum(0).expand(2, -1), rtol=1e-4, atol=1e-3)


def test_narrow_layers_other_dtypes_and_the_switch_take_f_linear(monkeypatch):
    w = torch.randn(100, 16)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(llama.output_layer(x, w), F.linear(x, w))  # narrower than FAST_HEAD_MIN_OUT
        wide = torch.randn(llama.FAST_HEAD_MIN_OUT, 16, dtype=torch.float64)
        xd = x.double()
        assert torch.equal(llama.output_layer(xd, wide), F.linear(xd, wide))
        monkeypatch.setattr(llama, "ONEDNN_HEAD", False)
        wide = torch.randn(llama.FAST_HEAD_MIN_OUT, 16)
        assert torch.equal(llama.output_layer(x, wide), F.linear(x, wide))
