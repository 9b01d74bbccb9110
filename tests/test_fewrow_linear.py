"""The few-row linear kernel (`kernels/fewrow_linear.cpp`) against its torch reference, and its batch invariance:
a row's result is bit-identical computed alone or among 2-16 others, on every shape SmolLM2 multiplies."""

import pytest
import torch
import torch.nn.functional as F

from entmtp_sglang.kernels import fewrow_linear as FR

pytestmark = pytest.mark.skipif(not FR.available(), reason=f"kernel not built: {FR.unavailable_reason()}")

# (out_features, in_features): SmolLM2-135M's q, k/v, o, gate/up, down, stacked qkv and gate_up, the output layer;
# its EAGLE drafter's fc (two hidden states in) and output layer over the 8,192-token draft vocabulary
SMOLLM2 = [(576, 576), (192, 576), (1536, 576), (576, 1536), (960, 576), (3072, 576), (49152, 576),
           (576, 1152), (8192, 576)]


def _data(out_features, in_features, rows, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    x = torch.randn(rows, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("out_features,in_features", SMOLLM2)
def test_every_row_is_bit_identical_alone_and_among_1_to_16_rows(out_features, in_features):
    x, w, _ = _data(out_features, in_features, 16, seed=out_features + in_features)
    p = FR.pack(w)
    with torch.no_grad():
        alone = torch.cat([FR.fewrow_linear_packed(x[i:i + 1], p) for i in range(16)])
        for rows in range(1, 17):
            together = FR.fewrow_linear_packed(x[:rows], p)
            assert torch.equal(together, alone[:rows]), rows
        # any subset, in any order, gives each row the same bits
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))[:11]
        assert torch.equal(FR.fewrow_linear_packed(x[perm], p), alone[perm])


@pytest.mark.parametrize("out_features,in_features", [(576, 576), (3072, 576), (576, 1536), (100, 300), (33, 129)])
def test_many_rows_carry_their_chains_across_k_chunks_bit_for_bit(out_features, in_features):
    """Past one tile of rows the sum over k runs in chunks, every tile over a chunk before the next (the chunk stays
    in L1): each row still gets the bits it gets alone, with a bias, for in_features on and off a chunk's edge."""
    x, w, b = _data(out_features, in_features, 45, seed=in_features, bias=True)
    p = FR.pack(w)
    with torch.no_grad():
        alone = torch.cat([FR.fewrow_linear_packed(x[i:i + 1], p, b) for i in range(45)])
        for rows in (9, 12, 13, 24, 31, 45):
            assert torch.equal(FR.fewrow_linear_packed(x[:rows], p, b), alone[:rows]), rows
    torch.testing.assert_close(alone, FR.fewrow_linear_torch(x, w, b), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("out_features,in_features", SMOLLM2)
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_agrees_with_the_reference_within_float32_rounding(out_features, in_features, rows):
    x, w, _ = _data(out_features, in_features, rows, seed=rows)
    out = FR.fewrow_linear(x, w, backend="cpu")
    ref = FR.fewrow_linear_torch(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * in_features ** 0.5)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("out_features", [1, 7, 31, 33, 65, 100])
@pytest.mark.parametrize("in_features", [1, 5, 17, 64])
@pytest.mark.parametrize("rows", [1, 2, 9, 40])
def test_odd_sizes_and_bias(out_features, in_features, rows):
    """Feature counts that fill no whole block, row counts past one tile, a bias."""
    x, w, b = _data(out_features, in_features, rows, seed=out_features * in_features + rows, bias=True)
    out = FR.fewrow_linear(x, w, b, backend="cpu")
    torch.testing.assert_close(out, FR.fewrow_linear_torch(x, w, b), rtol=1e-5, atol=1e-5)
    p = FR.pack(w)
    assert torch.equal(FR.fewrow_linear_packed(x[:1], p, b), out[:1])


def test_leading_dimensions_noncontiguous_rows_and_empty_input():
    x, w, b = _data(40, 24, 12, seed=5, bias=True)
    p = FR.pack(w)
    ref = FR.fewrow_linear_packed(x, p, b)
    assert torch.equal(FR.fewrow_linear_packed(x.view(3, 4, 24), p, b), ref.view(3, 4, 40))
    wide = torch.zeros(12, 50)
    wide[:, 3:27] = x
    assert torch.equal(FR.fewrow_linear_packed(wide[:, 3:27], p, b), ref)  # row stride 50
    assert torch.equal(FR.fewrow_linear_packed(x.t().contiguous().t(), p, b), ref)  # column-major
    assert FR.fewrow_linear_packed(x[:0], p, b).shape == (0, 40)


def test_bad_input_is_refused_with_a_message():
    x, w, _ = _data(40, 24, 2, seed=6)
    p = FR.pack(w)
    with pytest.raises(RuntimeError, match="features"):
        FR.fewrow_linear_packed(torch.randn(2, 23), p)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.entmtp.fewrow_linear(x.double(), p.packed, None, 40)
    with pytest.raises(ValueError, match="backend"):
        FR.fewrow_linear(x, w, backend="cuda")
    with pytest.raises(ValueError, match="float32"):
        FR.fewrow_linear(x.double(), w.double(), backend="cpu")


def test_the_isa_and_block_width_are_reported():
    assert FR.isa() in ("avx512", "avx2", "scalar")
    assert torch.ops.entmtp.fewrow_block() in (16, 32)


@pytest.mark.slow
def test_the_avx2_and_scalar_builds_agree_bit_for_bit_with_this_one(tmp_path):
    """Builds the same source for AVX2 and for plain x86-64 (no FMA unit: the compiler's exact fmaf) under their own
    op namespaces and compares them with the loaded build on SmolLM2's shapes, 1-16 rows, with a bias."""
    from torch.utils import cpp_extension

    variants = {"avx2": ["-march=native", "-mno-avx512f"], "scalar": ["-march=x86-64", "-mno-avx2", "-mno-fma"]}
    for name, flags in variants.items():
        src = tmp_path / f"{name}.cpp"
        src.write_text(FR.SOURCE.read_text().replace("TORCH_LIBRARY(entmtp", f"TORCH_LIBRARY(entmtp_{name}")
                       .replace("TORCH_LIBRARY_IMPL(entmtp", f"TORCH_LIBRARY_IMPL(entmtp_{name}"))
        cpp_extension.load(name=f"entmtp_fewrow_{name}", sources=[str(src)], build_directory=str(tmp_path),
                           extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    ops = [torch.ops.entmtp, torch.ops.entmtp_avx2, torch.ops.entmtp_scalar]
    if FR.isa() == "avx512":
        assert [op.fewrow_isa() for op in ops[1:]] == ["avx2", "scalar"]
    for out_features, in_features in [*SMOLLM2[:6], (8192, 576), (100, 17)]:
        for rows in (1, 2, 3, 5, 8, 9, 13, 16):
            x, w, b = _data(out_features, in_features, rows, seed=rows, bias=True)
            ys = [op.fewrow_linear(x, op.fewrow_pack(w), b, out_features) for op in ops]
            assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), (out_features, in_features, rows)


def test_each_torch_installation_builds_in_its_own_directory(monkeypatch, tmp_path):
    """Two environments with the same torch version must not share a build: each would rebuild the library the
    other has loaded (a fresh clone's venv beside a checkout's did, and the running tests read a half-written one)."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    here = FR.build_dir()
    assert here.parent == tmp_path / "kernels" and here == FR.build_dir()
    monkeypatch.setattr(FR.torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert FR.build_dir() != here
