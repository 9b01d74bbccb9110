"""Tree attention: the SDPA path (bit for bit what the model ran before the dispatcher), the packed custom
mask FlashInfer reads (bit order, metamorphic: a packed lower-triangular mask is causal attention), the
dispatcher, and the FlashInfer path against the torch reference on a GPU (skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from entmtp_sglang.engine.batch_tree import pad_trees, tree_attention_mask
from entmtp_sglang.kernels import (
    flashinfer_available,
    pack_tree_mask_torch,
    segment_packbits_torch,
    tree_attention,
    tree_attention_torch,
    unpack_tree_mask_torch,
)
from entmtp_sglang.kernels.tree_attention import resolve_attention_backend, tree_attention_packed_torch
from entmtp_sglang.model.llama import Attention, LlamaForCausalLM, LlamaShape, init_weights
from entmtp_sglang.tree import Tree, from_sglang

HAS_CUDA = torch.cuda.is_available()


def needs_flashinfer(test):
    """The gpu marker, and a skip with the reason where there is no CUDA device or no flashinfer."""
    test = pytest.mark.skipif(not HAS_CUDA, reason="FlashInfer tree attention needs a CUDA device")(test)
    test = pytest.mark.skipif(not flashinfer_available(),
                              reason="flashinfer is not installed (bench/gpu_check.sh brings it)")(test)
    return pytest.mark.gpu(test)

#        0            two requests, each its own tree after its own committed prefix:
#      /   \          request 0: prefix 3 slots, tree (-1, 0, 0, 1, 2)
#     1     2         request 1: prefix 5 slots, chain:2 padded to 5 nodes
#     |     |
#     3     4
TREES = [Tree((-1, 0, 0, 1, 2)), Tree.chain(2)]


def _qkv(gen, b, nh, n_kv, t, cap, hd, dtype=torch.float32, device="cpu"):
    q = torch.randn(b, nh, t, hd, generator=gen).to(device, dtype)
    k = torch.randn(b, n_kv, cap, hd, generator=gen).to(device, dtype)
    v = torch.randn(b, n_kv, cap, hd, generator=gen).to(device, dtype)
    return q, k, v


def _tree_mask(trees, prefix_lens):
    return tree_attention_mask(torch.tensor(prefix_lens), pad_trees(trees))  # (B, 1, N, S)


# ----------------------------------------------------------------------------------------------- SDPA path


def test_torch_path_is_bit_identical_to_the_models_former_attention():
    """The model's attention with a cache and a tree mask equals, bit for bit, what it computed before the
    dispatcher existed: slice the cache to the mask's span, repeat the KV heads, SDPA with the mask."""
    torch.manual_seed(0)
    shape = LlamaShape(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(shape)
    init_weights(model, std=0.3)
    attn: Attention = model.model.layers[0].self_attn
    cache = model.new_cache(2, 20)
    cache.k[0].normal_()
    cache.v[0].normal_()
    mask = _tree_mask(TREES, [3, 5])  # (2, 1, 5, 10)
    x = torch.randn(2, 5, 32)
    positions = torch.tensor([[3, 4, 4, 5, 5], [5, 6, 7, 5, 5]])
    start = torch.tensor([3, 5])
    got = attn(x, positions, model.rotary, mask, cache, 0, start)

    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, 4, 8).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, 2, 8).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, 2, 8).transpose(1, 2)
    q, k = model.rotary(q, positions), model.rotary(k, positions)
    span = mask.shape[-1]
    k, v = cache.k[0][:, :, :span], cache.v[0][:, :, :span]  # the cache already holds the new k, v
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = attn.o_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, -1))
    assert torch.equal(got, want)


def test_tree_attention_torch_equals_a_written_out_softmax():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(gen, 2, 4, 2, 5, 12, 8)
    mask = _tree_mask(TREES, [3, 5])  # S = 10 of C = 12 slots
    got = tree_attention(q, k, v, mask, backend="torch")
    want = torch.empty_like(q)
    for b in range(2):
        for h in range(4):
            for t in range(5):
                keys = mask[b, 0, t].nonzero().flatten()
                w = torch.softmax(q[b, h, t] @ k[b, h // 2, keys].T / 8 ** 0.5, -1)
                want[b, h, t] = w @ v[b, h // 2, keys]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_arguments_get_clear_errors():
    q, k, v = _qkv(torch.Generator().manual_seed(2), 1, 4, 2, 3, 6, 8)
    with pytest.raises(ValueError, match="mask must be bool"):
        tree_attention(q, k, v, torch.ones(1, 1, 3, 7, dtype=torch.bool))  # S > C
    with pytest.raises(ValueError, match="mask must be bool"):
        tree_attention(q, k, v, torch.ones(1, 1, 3, 6))
    with pytest.raises(ValueError, match="do not fit"):
        tree_attention(q, k[:, :, :, :4], v[:, :, :, :4], torch.ones(1, 1, 3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="unknown attention backend"):
        tree_attention(q, k, v, torch.ones(1, 1, 3, 6, dtype=torch.bool), backend="triton")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown attention backend"):
        LlamaForCausalLM(LlamaShape(50, 32, 64, 1, 4, 2, 64)).set_attention_backend("cuda")


def test_auto_runs_torch_on_cpu_and_flashinfer_is_refused_there():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    assert resolve_attention_backend("auto", q) == "torch"
    with pytest.raises((ImportError, ValueError), match="flashinfer"):
        resolve_attention_backend("flashinfer", q)


# ----------------------------------------------------------------------------------------------- packed mask


@pytest.mark.parametrize("seglens", [[16], [3, 13, 8, 1], [0, 9, 17]])
def test_segment_packbits_equals_numpy_packbits_little_per_segment(seglens):
    gen = torch.Generator().manual_seed(3)
    bits = torch.rand(sum(seglens), generator=gen) < 0.5
    indptr = torch.tensor([0] + list(np.cumsum(seglens)))
    packed, packed_indptr = segment_packbits_torch(bits, indptr)
    assert packed.dtype == torch.uint8 and packed_indptr.dtype == torch.int32
    assert packed_indptr.tolist() == [0] + list(np.cumsum([(n + 7) // 8 for n in seglens]))
    for i in range(len(seglens)):
        seg = bits[indptr[i]:indptr[i + 1]].numpy()
        want = np.packbits(seg, bitorder="little")
        assert packed[packed_indptr[i]:packed_indptr[i + 1]].numpy().tolist() == want.tolist()


def test_bit_order_by_hand():
    # one request, T = 1, S = 10: slots 0, 2 and 9 visible -> byte 0 = 0b00000101, byte 1 = 0b00000010
    mask = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    mask[0, 0, 0, [0, 2, 9]] = True
    packed, packed_indptr = pack_tree_mask_torch(mask)
    assert packed.tolist() == [0b101, 0b10] and packed_indptr.tolist() == [0, 2]
    assert torch.equal(unpack_tree_mask_torch(packed, packed_indptr, 1, 10), mask)


def test_pack_unpack_roundtrip_on_tree_masks():
    trees = [from_sglang(3, 4, 10), Tree((-1, 0, 0, 1, 1, 2)), Tree.chain(4)]
    mask = _tree_mask(trees, [7, 0, 13])  # (3, 1, 10, 23): segments of 230 bits, not byte-aligned
    packed, packed_indptr = pack_tree_mask_torch(mask)
    assert packed_indptr.tolist() == [0, 29, 58, 87]
    assert torch.equal(unpack_tree_mask_torch(packed, packed_indptr, 10, 23), mask)


@pytest.mark.parametrize("b,t", [(1, 7), (3, 5)])
def test_packed_lower_triangular_mask_is_causal_attention(b, t):
    """Metamorphic: a lower-triangular custom mask, packed and read back as the kernel reads it, gives
    exactly causal attention (a wrong bit order would show a different pattern)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = _qkv(gen, b, 4, 2, t, t, 16)
    tril = torch.ones(t, t, dtype=torch.bool).tril().expand(b, 1, t, t)
    packed, packed_indptr = pack_tree_mask_torch(tril)
    got = tree_attention_packed_torch(q, k, v, packed, packed_indptr, t)
    causal = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(got, causal, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------- FlashInfer


# (dtype, head_dim) as the GPU check uses them (each pair is one FlashInfer JIT build): float16 with 64
# (the bundled model, SmolLM2), bfloat16 with 128 (Llama-3.1-8B)
@needs_flashinfer
@pytest.mark.parametrize("dtype,nh,n_kv,hd", [(torch.float16, 4, 4, 64), (torch.float16, 9, 3, 64),
                                              (torch.bfloat16, 32, 8, 128)])
def test_flashinfer_tree_attention_matches_torch(dtype, nh, n_kv, hd):
    from entmtp_sglang.kernels import tree_attention_flashinfer as fi

    gen = torch.Generator().manual_seed(5)
    trees = [from_sglang(3, 4, 10), Tree((-1, 0, 0, 1, 1, 2)), Tree.chain(4), Tree.chain(0)]
    prefix = [37, 0, 130, 5]
    q, k, v = _qkv(gen, 4, nh, n_kv, 10, 160, hd, dtype, "cuda")
    mask = _tree_mask(trees, prefix).cuda()
    before = fi.plans_made
    got = tree_attention(q, k, v, mask, backend="flashinfer")
    assert fi.plans_made == before + 1
    want = tree_attention_torch(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    tree_attention(q, k, v, mask, backend="flashinfer")  # same mask tensor: the plan is reused
    assert fi.plans_made == before + 1


@needs_flashinfer
@pytest.mark.parametrize("dtype,hd", [(torch.float16, 64), (torch.bfloat16, 128)])
def test_flashinfer_lower_triangular_custom_mask_equals_causal(dtype, hd):
    """Metamorphic, on the real kernel: plan(custom_mask=tril) gives what plan(causal=True) gives."""
    import flashinfer

    gen = torch.Generator().manual_seed(6)
    b, t, nh, n_kv = 3, 37, 8, 2
    q, k, v = _qkv(gen, b, nh, n_kv, t, t, hd, dtype, "cuda")
    tril = torch.ones(t, t, dtype=torch.bool, device="cuda").tril().expand(b, 1, t, t).contiguous()
    custom = tree_attention(q, k, v, tril, backend="flashinfer")
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="HND", backend="fa2")  # no extra JIT build
    ar = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    w.plan(ar * t, ar, ar[:b], torch.full((b,), t, dtype=torch.int32, device="cuda"), nh, n_kv, hd, t,
           causal=True, q_data_type=dtype)
    causal = w.run(q.transpose(1, 2).reshape(b * t, nh, hd), (k, v)).view(b, t, nh, hd).transpose(1, 2)
    torch.testing.assert_close(custom, causal, rtol=1e-3, atol=1e-3)


@needs_flashinfer
def test_torch_packing_equals_flashinfer_segment_packbits():
    import flashinfer

    mask = _tree_mask([from_sglang(3, 4, 10), Tree((-1, 0, 0, 1, 1, 2)), Tree.chain(4)], [7, 0, 13]).cuda()
    b, _, t, s = mask.shape
    ours, ours_indptr = pack_tree_mask_torch(mask)
    theirs, theirs_indptr = flashinfer.segment_packbits(
        mask.reshape(-1), torch.arange(b + 1, dtype=torch.int32, device="cuda") * (t * s), bitorder="little")
    assert torch.equal(ours, theirs) and ours_indptr.tolist() == theirs_indptr.tolist()


def test_backend_setting_changes_no_weights():
    """Switching the attention backend changes no parameter or buffer (state dicts stay loadable)."""
    model = LlamaForCausalLM(LlamaShape(50, 32, 64, 2, 4, 2, 64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_attention_backend("torch")
    assert all(m.backend == "torch" for m in model.modules() if isinstance(m, Attention))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------------------------- on device


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_target_on_device_is_transparent_on_the_cpu(random_models, kind):
    """TargetOnDevice carries everything the engine and plain decoding ask of a target: on the CPU in
    float32 it gives exactly the outputs of the model itself (the GPU check runs it on CUDA)."""
    from entmtp_sglang.engine.engine import Engine, static_chooser
    from entmtp_sglang.engine.plain import generate_plain
    from entmtp_sglang.model.on_device import TargetOnDevice

    target, drafters = random_models
    wrapped = TargetOnDevice(target, "cpu", torch.float32, attention="torch")
    assert wrapped.module is not target  # a copy: the caller's model stays where it was
    prompts = [[5, 17, 42, 8], [3, 9]]
    ref = [generate_plain(target, p, 12) for p in prompts]
    assert [generate_plain(wrapped, p, 12) for p in prompts] == ref
    tree = from_sglang(3, 4, 10)
    got = Engine(wrapped, kind, drafters[kind]).generate(prompts, 12, static_chooser(tree))
    want = Engine(target, kind, drafters[kind]).generate(prompts, 12, static_chooser(tree))
    assert [r.output_ids for r in got] == [r.output_ids for r in want] == ref
