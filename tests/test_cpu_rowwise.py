"""The plugin's hooks on SGLang's float32 CPU RMSNorm, SiLU-and-mul and rotary embedding (`sglang/cpu/rowwise.py`),
called on SGLang's own layer classes as SGLang calls them: the row-wise ops where they apply (the same results as
SGLang's `forward_native` to float32 rounding, the rotary embedding exactly), SGLang's code everywhere else."""

import pytest
import torch

from entmtp_sglang.kernels import rowwise_ops as R
from entmtp_sglang.sglang.cpu import rowwise as cpu_rowwise

pytestmark = pytest.mark.skipif(not R.available(), reason=f"ops not built: {R.unavailable_reason()}")


@pytest.fixture(scope="module")
def sgl():
    """SGLang's layer modules, imported when a test here runs, never at collection: SGLang imports triton, and
    tests/test_kernels.py must switch Triton's CPU interpreter on before anything imports it."""
    names = ("layernorm", "activation", "rotary_embedding.base", "rotary_embedding.utils")
    mods = [pytest.importorskip(f"sglang.srt.layers.{n}", reason="SGLang is not installed") for n in names]
    return dict(zip(("layernorm", "activation", "rotary", "rotary_utils"), mods))


class Spy:
    """SGLang's `forward_native`, recording that it ran."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_rmsnorm_with_and_without_the_residual(sgl):
    layernorm = sgl["layernorm"]
    torch.manual_seed(0)
    norm = layernorm.RMSNorm(576, eps=1e-5)
    norm.weight.data.normal_()
    x, res = torch.randn(3, 576), torch.randn(3, 576)
    spy = Spy(layernorm.RMSNorm.forward_native)
    with torch.inference_mode():
        y = cpu_rowwise.rmsnorm(spy, norm, x)
        y2, s2 = cpu_rowwise.rmsnorm(spy, norm, x, res)
        ref = layernorm.RMSNorm.forward_native(norm, x)
        ref2, rs2 = layernorm.RMSNorm.forward_native(norm, x, res)
        assert spy.calls == 0
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(y2, ref2, rtol=2e-6, atol=2e-6)
        assert torch.equal(s2, rs2)
        assert torch.equal(cpu_rowwise.rmsnorm(spy, norm, x[1:2]), y[1:2])   # batch-invariant
        cpu_rowwise.rmsnorm(spy, norm, x, res, post_residual_addition=torch.ones(3, 576))
        cpu_rowwise.rmsnorm(spy, norm, x.double())
    assert spy.calls == 2
    cpu_rowwise.rmsnorm(spy, norm, x)   # autograd on
    assert spy.calls == 3


def test_silu_and_mul(sgl):
    activation = sgl["activation"]
    act = activation.SiluAndMul()
    x = torch.randn(4, 3072) * 3
    spy = Spy(activation.SiluAndMul.forward_native)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_rowwise.silu_and_mul(spy, act, x), activation.SiluAndMul.forward_native(act, x),
                                   rtol=3e-6, atol=1e-6)
        cpu_rowwise.silu_and_mul(spy, act, x.bfloat16())
    assert spy.calls == 1


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_embedding_equals_sglangs_exactly(sgl, neox):
    rotary, rotary_utils = sgl["rotary"], sgl["rotary_utils"]
    # built by hand: the constructor's kernel imports follow the platform SGLang saw at import (vllm off the CPU
    # engine); forward_native reads only these attributes
    rope = rotary.RotaryEmbedding.__new__(rotary.RotaryEmbedding)
    torch.nn.Module.__init__(rope)
    rope.head_size, rope.rotary_dim, rope.is_neox_style = 64, 64, neox
    inv = 1.0 / (100000 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    f = torch.einsum("i,j->ij", torch.arange(2048, dtype=torch.float), inv)
    rope.cos_sin_cache = torch.cat((f.cos(), f.sin()), dim=-1)
    rope._apply_rotary_emb_wrapped = rotary_utils.apply_rotary_emb
    pos = torch.tensor([0, 7, 700, 2047])
    q, k = torch.randn(4, 9 * 64), torch.randn(4, 3 * 64)
    spy = Spy(rotary.RotaryEmbedding.forward_native)
    with torch.inference_mode():
        qo, ko = cpu_rowwise.rope(spy, rope, pos, q, k)
        rq, rk = rotary.RotaryEmbedding.forward_native(rope, pos, q, k)
        assert spy.calls == 0
        assert torch.equal(qo, rq) and torch.equal(ko, rk)
        cpu_rowwise.rope(spy, rope, pos, q, k, offsets=torch.zeros_like(pos))
    assert spy.calls == 1
