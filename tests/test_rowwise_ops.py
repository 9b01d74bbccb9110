"""The row-wise ops (`kernels/rowwise_ops.cpp`: RMSNorm, add + RMSNorm, SiLU-and-mul, rotary embedding) against
their torch references, and their batch invariance: a row's result is bit-identical computed alone or among others."""

import pytest
import torch

from entmtp_sglang.kernels import rowwise_ops as R

pytestmark = pytest.mark.skipif(not R.available(), reason=f"ops not built: {R.unavailable_reason()}")

ROWS = [1, 2, 3, 5, 8, 16, 70, 200]   # 70 and 200 span several tasks of the row-parallel loop


def _g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n", [576, 64, 17, 1])
@pytest.mark.parametrize("rows", ROWS)
def test_rmsnorm_agrees_with_the_reference_and_is_batch_invariant(n, rows):
    g = _g(rows * 1000 + n)
    x, res, w = (torch.randn(rows, n, generator=g) * 3 for _ in range(3))
    w = w[0]
    y = R.rmsnorm(x, w, 1e-5)
    torch.testing.assert_close(y, R.rmsnorm_torch(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    y2, s2 = R.add_rmsnorm(x, res, w, 1e-5)
    ry, rs = R.add_rmsnorm_torch(x, res, w, 1e-5)
    assert torch.equal(s2, rs)   # the residual sum is one float add
    torch.testing.assert_close(y2, ry, rtol=2e-6, atol=2e-6)
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(R.rmsnorm(x[i:i + 1].clone(), w, 1e-5), y[i:i + 1])
        a, b = R.add_rmsnorm(x[i:i + 1].clone(), res[i:i + 1].clone(), w, 1e-5)
        assert torch.equal(a, y2[i:i + 1]) and torch.equal(b, s2[i:i + 1])


def test_rmsnorm_keeps_leading_dimensions():
    x, w = torch.randn(2, 3, 576, generator=_g(1)), torch.randn(576, generator=_g(2))
    assert R.rmsnorm(x, w, 1e-6).shape == (2, 3, 576)
    torch.testing.assert_close(R.rmsnorm(x, w, 1e-6), R.rmsnorm_torch(x, w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("d", [1536, 7])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_agrees_with_the_reference_and_is_batch_invariant(d, rows):
    x = torch.randn(rows, 2 * d, generator=_g(rows + d)) * 4
    y = R.silu_and_mul(x)
    assert y.shape == (rows, d)
    torch.testing.assert_close(y, R.silu_and_mul_torch(x), rtol=3e-6, atol=1e-6)
    for i in {0, rows - 1}:
        assert torch.equal(R.silu_and_mul(x[i:i + 1].clone()), y[i:i + 1])


def test_silu_and_mul_over_the_whole_float_range_of_its_exp():
    """The op's own exp (Cephes' polynomial, clamped to [-87, 88]) against float64 silu, from where exp(-a)
    overflows a float to where it underflows, and zero."""
    a = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.5])])
    x = torch.cat([a, torch.full_like(a, 1.5)]).view(1, -1)
    y = R.silu_and_mul(x)[0].double()
    ref = R.silu_and_mul_torch(x.double())[0]
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, rtol=4e-7, atol=1e-30)


def _cache(max_pos, rotary_dim, base=100000.0):
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    f = torch.einsum("i,j->ij", torch.arange(max_pos, dtype=torch.float), inv)
    return torch.cat((f.cos(), f.sin()), dim=-1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rotary_dim,q_heads,k_heads", [(64, 64, 9, 3), (64, 32, 4, 2), (16, 8, 1, 1)])
@pytest.mark.parametrize("rows", [1, 2, 6, 70, 200])
def test_rope_equals_the_reference_exactly_and_is_batch_invariant(neox, head_size, rotary_dim, q_heads, k_heads,
                                                                  rows):
    g = _g(rows + head_size + rotary_dim + neox)
    cache = _cache(4096, rotary_dim)
    pos = torch.randint(0, 4096, (rows,), generator=g)
    q = torch.randn(rows, q_heads * head_size, generator=g)
    k = torch.randn(rows, k_heads * head_size, generator=g)
    qo, ko = R.rope(pos, q, k, cache, head_size, neox)
    rq, rk = R.rope_torch(pos, q, k, cache, head_size, neox)
    assert torch.equal(qo, rq) and torch.equal(ko, rk)   # the same element-wise ops, no fused multiply-add
    assert not torch.equal(qo, q)   # the rotation did something
    i = rows - 1
    a, b = R.rope(pos[i:i + 1].clone(), q[i:i + 1].clone(), k[i:i + 1].clone(), cache, head_size, neox)
    assert torch.equal(a, qo[i:i + 1]) and torch.equal(b, ko[i:i + 1])


def test_rope_takes_three_dimensional_heads_and_no_tokens():
    cache = _cache(16, 64)
    pos = torch.tensor([3, 5])
    q, k = torch.randn(2, 9, 64, generator=_g(3)), torch.randn(2, 3, 64, generator=_g(4))
    qo, ko = R.rope(pos, q, k, cache, 64, True)
    assert qo.shape == q.shape and torch.equal(qo, R.rope_torch(pos, q, k, cache, 64, True)[0])
    e = torch.empty(0, 576)
    a, b = R.rope(torch.empty(0, dtype=torch.long), e, e, cache, 64, True)
    assert a.shape == (0, 576) and b.shape == (0, 576)


def test_bad_input_is_refused_with_a_message():
    w = torch.randn(576)
    with pytest.raises(RuntimeError, match="float32"):
        R.rmsnorm(torch.randn(2, 576, dtype=torch.float64), w, 1e-5)
    with pytest.raises(RuntimeError, match="576 features"):
        R.rmsnorm(torch.randn(2, 575), w, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        R.rmsnorm(torch.randn(576, 2).T, w, 1e-5)
    with pytest.raises(RuntimeError, match="differ"):
        R.add_rmsnorm(torch.randn(2, 576), torch.randn(3, 576), w, 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        R.silu_and_mul(torch.randn(2, 5))
    cache = _cache(8, 64)
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        R.rope(torch.tensor([8]), torch.randn(1, 64), torch.randn(1, 64), cache, 64, True)
    with pytest.raises(RuntimeError, match="int64"):
        R.rope(torch.tensor([1], dtype=torch.int32), torch.randn(1, 64), torch.randn(1, 64), cache, 64, True)
    with pytest.raises(RuntimeError, match="tokens"):
        R.rope(torch.tensor([1, 2]), torch.randn(2, 60), torch.randn(2, 64), cache, 64, True)
