"""The plugin's hooks on SGLang's float32 CPU linear layers (`sglang/cpu/linear.py`), called as SGLang calls them:
the machine's path where it applies, SGLang's own code everywhere else. No SGLang needed."""

import types

import pytest
import torch
import torch.nn.functional as F

from entmtp_sglang.kernels import fewrow_linear as FR
from entmtp_sglang.model import linear as L
from entmtp_sglang.sglang.cpu import linear as cpu_linear

PACKING = [pytest.param("fewrow", marks=pytest.mark.skipif(not FR.available(), reason="kernel not built")),
           pytest.param("onednn", marks=pytest.mark.skipif(not L._HAS_ONEDNN, reason="no oneDNN"))]


@pytest.fixture(params=PACKING)
def path(request, monkeypatch):
    monkeypatch.setattr(L, "choose_path", lambda: request.param)
    return request.param


def _original(calls):
    def original(self, layer, x, bias=None):
        calls.append(layer)
        return F.linear(x, layer.weight, bias)
    return original


def test_a_plain_layer_takes_the_packed_path_batch_invariantly(path):
    torch.manual_seed(0)
    layer = torch.nn.Linear(576, 960)
    x = torch.randn(7, 576)
    calls = []
    with torch.inference_mode():
        out = cpu_linear.linear_apply(_original(calls), None, layer, x, layer.bias)
        alone = cpu_linear.linear_apply(_original(calls), None, layer, x[:1], layer.bias)
    assert not calls
    assert torch.equal(out[:1], alone)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert isinstance(layer._entmtp_packed, L.PackedWeight) and layer._entmtp_packed.path == path


@pytest.mark.parametrize("case", ["amx", "bfloat16", "autograd"])
def test_other_layers_keep_sglangs_code(path, case):
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64)
    if case == "amx":
        layer.use_intel_amx_backend = True
    if case == "bfloat16":
        layer, x = layer.to(torch.bfloat16), x.to(torch.bfloat16)
    calls = []
    if case == "autograd":
        cpu_linear.linear_apply(_original(calls), None, layer, x)
    else:
        with torch.inference_mode():
            cpu_linear.linear_apply(_original(calls), None, layer, x)
    assert calls == [layer]


def test_the_output_layer_takes_the_packed_path(path):
    head = types.SimpleNamespace(weight=torch.randn(1000, 64), quant_method=None)
    processor = types.SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    hidden = torch.randn(5, 64)
    with torch.inference_mode():
        out = cpu_linear.lm_head(lambda *a, **k: pytest.fail("SGLang's own path taken"), processor, hidden, head)
        alone = cpu_linear.lm_head(None, processor, hidden[2:3], head)
    torch.testing.assert_close(out, hidden @ head.weight.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[2:3], alone)


def test_nothing_is_hooked_where_the_machines_choice_is_f_linear(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.setattr(L, "choose_path", lambda: "torch")
    checked = []
    cpu_linear.register_hooks(lambda dotted, params: checked.append(dotted))
    assert checked == []  # returned before checking or registering anything


@pytest.mark.skipif(not FR.available(), reason="kernel not built")
def test_the_fast_path_follows_the_weight_and_the_input(monkeypatch):
    """After the first call a layer keeps its packed weight for a cheap check per call; replacing the weight or
    changing it in place repacks, 3-d inputs keep their shape, and inputs the kernel does not take go to SGLang."""
    monkeypatch.setattr(L, "choose_path", lambda: "fewrow")
    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 40, bias=False)
    x = torch.randn(2, 3, 64)
    calls = []
    with torch.inference_mode():
        first = cpu_linear.linear_apply(_original(calls), None, layer, x)
        assert "_entmtp_fast" in layer.__dict__
        again = cpu_linear.linear_apply(_original(calls), None, layer, x)
        assert torch.equal(first, again) and again.shape == (2, 3, 40)
        assert torch.equal(cpu_linear.linear_apply(_original(calls), None, layer, x[1, 2:]), again[1, 2:])
        layer.weight.mul_(2)   # in place: a new version
        torch.testing.assert_close(cpu_linear.linear_apply(_original(calls), None, layer, x), 2 * first)
    layer.weight = torch.nn.Parameter(torch.zeros(40, 64), requires_grad=False)   # replaced
    with torch.inference_mode():
        assert not cpu_linear.linear_apply(_original(calls), None, layer, x).any()
        cpu_linear.linear_apply(_original(calls), None, layer.double(), x.double())
    assert calls == [layer]   # only the float64 layer took SGLang's code
    layer.float()
    cpu_linear.linear_apply(_original(calls), None, layer, x)   # autograd on
    assert calls == [layer, layer]


def test_a_drafters_torch_linear_layers_take_the_packed_path(path, monkeypatch):
    """`pack_torch_linears`: the plain `torch.nn.Linear` layers SGLang builds in a drafter (EAGLE's `fc`) take the
    machine's path, batch-invariantly, and `F.linear` where it does not apply (autograd); only on the CPU engine and
    where the machine's path is not `F.linear` itself."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1152, 576), torch.nn.ReLU(), torch.nn.Linear(576, 64, bias=False))
    x = torch.randn(6, 1152)
    with torch.inference_mode():
        before = model(x)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert cpu_linear.pack_torch_linears(model) == 0
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert cpu_linear.pack_torch_linears(model) == 2
    assert cpu_linear.pack_torch_linears(model) == 0     # once
    with torch.inference_mode():
        out, alone = model(x), model(x[2:3])
    assert torch.equal(out[2:3], alone)
    torch.testing.assert_close(out, before, rtol=1e-4, atol=1e-5)
    assert model[0].__dict__["_entmtp_packed"] is not None
    y = model(x.requires_grad_())                     # autograd: F.linear, gradients as before
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    monkeypatch.setattr(L, "choose_path", lambda: "torch")
    assert cpu_linear.pack_torch_linears(torch.nn.Linear(4, 4)) == 0
