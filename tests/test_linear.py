"""`model.linear.linear`: linear layers through the path picked for this machine (the few-row kernel, oneDNN on a
packed weight, or `F.linear`; CPU, float32, no autograd), each path checked against `F.linear` (the torch
reference) on random inputs, and the choice itself."""

import json

import pytest
import torch
import torch.nn.functional as F

from entmtp_sglang.kernels import fewrow_linear as FR
from entmtp_sglang.model import linear as L

needs_onednn = pytest.mark.skipif(not L._HAS_ONEDNN, reason="torch without oneDNN takes F.linear")
PACKING = [pytest.param("fewrow", marks=pytest.mark.skipif(not FR.available(), reason="kernel not built")),
           pytest.param("onednn", marks=needs_onednn)]


@pytest.fixture(params=PACKING)
def path(request, monkeypatch):
    monkeypatch.setattr(L, "choose_path", lambda: request.param)
    return request.param


@pytest.mark.parametrize("out_features", [7, 192, 4099])
@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (3, 5, 64), (16, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_within_float32_rounding(path, shape, out_features, bias):
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 64, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    with torch.no_grad():
        out = L.linear(x, w, b)
    assert out.shape == (*shape[:-1], out_features)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("out_features,in_features", [(576, 192), (960, 576), (576, 576), (3072, 576), (576, 1536)])
def test_a_rows_result_does_not_depend_on_the_other_rows(path, out_features, in_features):
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


def test_follows_in_place_weight_updates_and_keeps_autograd(path):
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


def test_other_dtypes_and_the_torch_path_take_f_linear(monkeypatch):
    x = torch.randn(3, 16)
    with torch.no_grad():
        wd = torch.randn(100, 16, dtype=torch.float64)
        assert torch.equal(L.linear(x.double(), wd), F.linear(x.double(), wd))
        monkeypatch.setattr(L, "choose_path", lambda: "torch")
        w = torch.randn(100, 16)
        assert torch.equal(L.linear(x, w), F.linear(x, w))


def test_the_environment_forces_a_path_and_names_the_choices_on_a_typo(monkeypatch):
    monkeypatch.delenv("ENTMTP_ONEDNN", raising=False)
    monkeypatch.setenv("ENTMTP_LINEAR", "onednn")
    assert L.forced_path() == "onednn"
    monkeypatch.setenv("ENTMTP_LINEAR", "auto")
    assert L.forced_path() is None
    monkeypatch.setenv("ENTMTP_LINEAR", "fast")
    with pytest.raises(ValueError, match="fewrow, onednn, torch"):
        L.forced_path()
    monkeypatch.delenv("ENTMTP_LINEAR")
    monkeypatch.setenv("ENTMTP_ONEDNN", "0")  # the older switch: SGLang's and torch's own layers
    assert L.forced_path() == "torch"


def test_the_choice_is_batch_invariant_and_measured_once_per_machine(tmp_path, monkeypatch):
    """Whatever this machine picks, its rows are bit-identical alone and among others on SmolLM2's shapes; the
    probe runs once and later processes read its choice from the cache."""
    monkeypatch.setenv("ENTMTP_CACHE", str(tmp_path))
    monkeypatch.delenv("ENTMTP_LINEAR", raising=False)
    monkeypatch.delenv("ENTMTP_ONEDNN", raising=False)
    L.choose_path.cache_clear()
    try:
        chosen = L.choose_path()
        assert chosen in L.PATHS
        record = json.loads((tmp_path / "linear_path.json").read_text())
        (decision,) = record.values()
        assert decision["path"] == chosen and decision["invariant"][chosen]
        assert set(decision["ms"]) == {p for p, ok in decision["invariant"].items() if ok}
        g = torch.Generator().manual_seed(0)
        shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (8192, 576)]
        assert L.batch_invariant(chosen, [torch.randn(o, k, generator=g) for o, k in shapes], rows=16)
        calls = []
        monkeypatch.setattr(L, "_decide", lambda: calls.append(1) or decision)
        L.choose_path.cache_clear()
        assert L.choose_path() == chosen and not calls  # read back, not measured again
    finally:
        L.choose_path.cache_clear()


def test_f_linear_is_refused_where_it_is_not_batch_invariant():
    """The probe's invariance check can fail: rows that depend on their neighbours are caught."""
    pack, mul = L._packer, L._multiply
    try:
        L._packer = lambda p: (lambda w: w)
        L._multiply = lambda p: (lambda x, w, b: F.linear(x, w) + 1e-3 * x.shape[0])
        assert not L.batch_invariant("torch", [torch.randn(8, 4)])
    finally:
        L._packer, L._multiply = pack, mul


def test_the_module_keeps_nn_linears_parameters_and_state_dict_names():
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 40)
    mod = L.Linear(24, 40)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == ["weight", "bias"]
    x = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), ref(x), rtol=1e-5, atol=1e-5)


def test_a_packed_model_copies_pickles_and_follows_load_state_dict(path):
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
