"""The pure-torch kernels against Hugging Face's formulas and a dense attention reference;
kernel dispatch; tensor-parallel shards of the linear layers."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import dispatch
from kernels.attention import build_attention_metadata
from kernels.rotary import rope_cos_sin_cache, rope_inv_freq


@pytest.fixture(autouse=True)
def _references():
    """These tests are of the pure-torch references: a runner built by an earlier test's
    module fixture may have put the native step kernels in `dispatch` for the CPU (tests
    of those are in test_native_kernel.py); conftest restores the choice afterwards."""
    from kernels import native

    native.unregister()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(7, 64).to(dtype)
    hf = LlamaRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(64) + 0.5)
        assert torch.equal(kernels.rms_norm(x, hf.weight, 1e-6), hf(x))
        residual = torch.randn(7, 64).to(dtype)
        normed, new_residual = kernels.fused_add_rms_norm(x, residual, hf.weight, 1e-6)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(normed, hf(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_bitwise_equal_to_hf_on_model_shapes(dtype):
    """The fused formulation must not drift from HF by even one ulp: hidden-size rows
    (batch 1 to a prefill) and per-head rows of qk-norm, small and large magnitudes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(3)
    for shape in [(1, 768), (64, 768), (513, 896), (5, 12, 64), (3, 4, 128), (2, 4096)]:
        for scale in (1e-3, 1.0, 300.0):
            x = (torch.randn(*shape) * scale).to(dtype)
            hf = LlamaRMSNorm(shape[-1], eps=1e-6).to(dtype)
            with torch.no_grad():
                hf.weight.copy_(torch.rand(shape[-1]) + 0.5)
                assert torch.equal(kernels.rms_norm(x, hf.weight, 1e-6), hf(x)), (shape, scale)


def test_silu_and_mul():
    x = torch.randn(5, 2 * 24)
    assert torch.equal(kernels.silu_and_mul(x), F.silu(x[:, :24]) * x[:, 24:])


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rotary_equals_hf(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta = 32, 500_000.0
    extra = {"rope_scaling": dict(scaling)} if scaling else {}
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=head_dim,
                         rope_theta=theta, max_position_embeddings=512, **extra)
    hf_rope = LlamaRotaryEmbedding(config)
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    assert torch.equal(inv_freq, hf_rope.inv_freq)
    # llama3 scaling leaves high frequencies, divides low ones, and blends between
    if scaling and scaling["rope_type"] == "llama3":
        plain = rope_inv_freq(head_dim, theta)
        assert inv_freq[0] == plain[0] and inv_freq[-1] == plain[-1] / 8.0

    positions = torch.tensor([0, 1, 2, 17, 300, 511])
    q, k = torch.randn(6, 4, head_dim), torch.randn(6, 2, head_dim)
    hf_cos, hf_sin = hf_rope(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        hf_cos, hf_sin)
    cos, sin = rope_cos_sin_cache(inv_freq, 512)[positions].chunk(2, dim=-1)
    q_out, k_out = kernels.apply_rotary(q, k, cos, sin)
    assert torch.allclose(q_out, q_ref[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(k_out, k_ref[0].transpose(0, 1), atol=1e-6)


def _dense_attention(q, k, v, start_pos):
    """Reference: q [n, H, D] at positions start_pos.., over k, v [start_pos + n, KVH, D]."""
    n, num_heads, head_dim = q.shape
    groups = num_heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(start_pos, start_pos + n)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_mixed_step_equals_dense(block_size):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, num_layers = 8, 2, 16, 3
    num_blocks = 64
    kv_cache = torch.zeros(num_blocks, 2, num_layers, block_size, num_kv_heads, head_dim)
    layer = 1
    k_cache, v_cache = kv_cache[:, 0, layer], kv_cache[:, 1, layer]
    free = list(range(num_blocks))
    random.Random(block_size).shuffle(free)
    # (cached prefix length, new tokens): fresh prompts, chunks after a prefix, decodes
    shapes = [(0, 1), (0, 9), (13, 1), (block_size, 1), (block_size - 1, 1), (20, 13),
              (2 * block_size, block_size), (3, 2), (37, 1)]
    spans, full_k, full_v = [], [], []
    for start, n in shapes:
        table = [free.pop() for _ in range(-(-(start + n) // block_size))]
        keys = torch.randn(start + n, num_kv_heads, head_dim)
        values = torch.randn(start + n, num_kv_heads, head_dim)
        for pos in range(start):  # the cached prefix, written by earlier steps
            k_cache[table[pos // block_size], pos % block_size] = keys[pos]
            v_cache[table[pos // block_size], pos % block_size] = values[pos]
        spans.append((start, n, table))
        full_k.append(keys)
        full_v.append(values)
    meta = build_attention_metadata(kv_cache, spans)
    q = torch.randn(sum(n for _, n in shapes), num_heads, head_dim)
    k_new = torch.cat([k[s:] for k, (s, _) in zip(full_k, shapes)])
    v_new = torch.cat([v[s:] for v, (s, _) in zip(full_v, shapes)])
    kernels.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
    out = kernels.paged_attention(q, k_new, v_new, k_cache, v_cache, meta)

    assert out.shape == (q.shape[0], num_heads * head_dim)
    row = 0
    for (start, n), keys, values in zip(shapes, full_k, full_v):
        ref = _dense_attention(q[row:row + n], keys, values, start)
        assert torch.allclose(out[row:row + n], ref, atol=1e-5), (start, n)
        row += n
    # the other layers' slabs were not touched
    assert kv_cache[:, :, 0].abs().sum() == 0 and kv_cache[:, :, 2].abs().sum() == 0


def test_paged_attention_pure_decode_batch():
    torch.manual_seed(1)
    block_size, num_blocks = 8, 32
    kv_cache = torch.randn(num_blocks, 2, 1, block_size, 2, 16)
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 1, 0]
    tables = [[5, 9, 2], [31], [0, 1, 3, 7, 8]]
    lens = [20, 3, 33]
    meta = build_attention_metadata(kv_cache, [(n - 1, 1, t) for n, t in zip(lens, tables)])
    assert meta.decodes is not None and meta.decodes.rows_are_all and not meta.chunks
    q = torch.randn(3, 4, 16)
    out = kernels.paged_attention(q, None, None, k_cache, v_cache, meta)
    for i, (table, n) in enumerate(zip(tables, lens)):
        keys = k_cache[table].flatten(0, 1)[:n]
        values = v_cache[table].flatten(0, 1)[:n]
        ref = _dense_attention(q[i:i + 1], keys, values, n - 1)
        assert torch.allclose(out[i:i + 1], ref, atol=1e-5)


@pytest.mark.parametrize("lens", [[30, 31, 25, 32], [5, 40]])
def test_decode_batch_padded_or_per_sequence_equals_dense(lens):
    """Nearly equal contexts run as one padded batch, uneven ones per sequence: both
    equal dense attention over exactly each context."""
    torch.manual_seed(5)
    block_size = 8
    kv_cache = torch.randn(40, 2, 2, block_size, 2, 16)
    k_cache, v_cache = kv_cache[:, 0, 1], kv_cache[:, 1, 1]
    free = list(range(40))
    random.Random(5).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = build_attention_metadata(kv_cache, [(n - 1, 1, t) for n, t in zip(lens, tables)])
    assert meta.decodes is not None
    assert bool(meta.decodes.groups) == (lens == [30, 31, 25, 32])
    q = torch.randn(len(lens), 6, 16)
    out = kernels.paged_attention(q, None, None, k_cache, v_cache, meta)
    for i, (table, n) in enumerate(zip(tables, lens)):
        keys = k_cache[table].flatten(0, 1)[:n]
        values = v_cache[table].flatten(0, 1)[:n]
        ref = _dense_attention(q[i:i + 1], keys, values, n - 1)
        assert torch.allclose(out[i:i + 1], ref, atol=1e-5), n


def test_decode_groups_of_similar_lengths_and_singles_beside_a_prompt_chunk():
    """Decodes sorted into padded groups of nearly equal lengths (in any order in the
    batch) and singles, in a step that also runs a prompt chunk: every row equals dense
    attention over exactly its context."""
    torch.manual_seed(6)
    block_size = 8
    lens = [30, 100, 31, 5, 25, 32, 29]  # blocks 4, 13, 4, 1, 4, 4, 4
    kv_cache = torch.randn(64, 2, 1, block_size, 2, 16)
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 1, 0]
    free = list(range(8, 64))
    random.Random(6).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    chunk_len = 6  # a fresh prompt in blocks 0..7, between the decodes
    spans = [(n - 1, 1, t) for n, t in zip(lens, tables)]
    spans.insert(3, (0, chunk_len, list(range(8))))
    meta = build_attention_metadata(kv_cache, spans)
    decodes = meta.decodes
    assert decodes is not None and not decodes.rows_are_all
    assert [g.members.tolist() for g in decodes.groups] == [[0, 2, 4, 5, 6]]
    assert decodes.singles == [1, 3]
    num_tokens = len(lens) + chunk_len
    q = torch.randn(num_tokens, 6, 16)
    k_new, v_new = torch.randn(num_tokens, 2, 16), torch.randn(num_tokens, 2, 16)
    kernels.store_kv(k_new, v_new, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
    out = kernels.paged_attention(q, k_new, v_new, k_cache, v_cache, meta)
    rows = [0, 1, 2] + [3 + chunk_len + i for i in range(4)]
    for row, table, n in zip(rows, tables, lens):
        keys = k_cache[table].flatten(0, 1)[:n]
        values = v_cache[table].flatten(0, 1)[:n]
        ref = _dense_attention(q[row:row + 1], keys, values, n - 1)
        assert torch.allclose(out[row:row + 1], ref, atol=1e-5), n
    ref = _dense_attention(q[3:3 + chunk_len], k_new[3:3 + chunk_len],
                           v_new[3:3 + chunk_len], 0)
    assert torch.allclose(out[3:3 + chunk_len], ref, atol=1e-5)


def test_decode_groups_keep_their_padded_gather_within_the_budget():
    from kernels.attention import _group_decodes

    groups, singles = _group_decodes([5] * 10, max_group_blocks=20)
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and singles == []
    groups, singles = _group_decodes([2, 9, 2, 3, 1], max_group_blocks=None)
    assert groups == [[0, 2]] and singles == [1, 3, 4]


def test_decode_reads_exactly_its_context():
    """A decode attends to its first `context_len` slots and nothing else: NaN in the
    unwritten tail of its last block, in blocks past its context in a longer table, in
    other sequences' blocks and in the other layers must not reach the output."""
    torch.manual_seed(4)
    block_size, num_blocks, num_layers = 4, 24, 2
    kv_cache = torch.full((num_blocks, 2, num_layers, block_size, 2, 16), float("nan"))
    k_cache, v_cache = kv_cache[:, 0, 1], kv_cache[:, 1, 1]
    # (context length, table): tables may list more blocks than the context needs
    cases = [(1, [7, 3]), (6, [11, 2, 19]), (8, [0, 5]), (13, [23, 9, 14, 1, 20])]
    for n, table in cases:
        blocks = table[: -(-n // block_size)]
        slots = k_cache[blocks].flatten(0, 1)
        slots[:n] = torch.randn(n, 2, 16)  # copy: write back below
        k_cache[blocks] = slots.view(len(blocks), block_size, 2, 16)
        slots = v_cache[blocks].flatten(0, 1)
        slots[:n] = torch.randn(n, 2, 16)
        v_cache[blocks] = slots.view(len(blocks), block_size, 2, 16)
    meta = build_attention_metadata(kv_cache, [(n - 1, 1, t) for n, t in cases])
    q = torch.randn(len(cases), 6, 16)
    out = kernels.paged_attention(q, None, None, k_cache, v_cache, meta)
    assert not out.isnan().any()
    for i, (n, table) in enumerate(cases):
        keys = k_cache[table].flatten(0, 1)[:n]
        values = v_cache[table].flatten(0, 1)[:n]
        ref = _dense_attention(q[i:i + 1], keys, values, n - 1)
        assert torch.allclose(out[i:i + 1], ref, atol=1e-5), n


def test_dispatch_uses_a_registered_backend_then_the_reference():
    from kernels.norms import rms_norm as reference

    calls = []

    def counting_rms_norm(x, weight, eps):
        calls.append(x.shape)
        return reference(x, weight, eps)

    x, w = torch.randn(3, 8), torch.ones(8)
    assert dispatch.get("rms_norm", "cpu") is reference
    dispatch.register("rms_norm", "cpu", counting_rms_norm)
    try:
        kernels.rms_norm(x, w, 1e-6)
        assert calls == [x.shape]
    finally:
        dispatch.unregister("rms_norm", "cpu")
    kernels.rms_norm(x, w, 1e-6)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="unknown kernel"):
        dispatch.register("flash_attn", "cpu", counting_rms_norm)


def test_tensor_parallel_shards_recombine_to_the_full_layer():
    from workers.engine.models.layers import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    torch.manual_seed(2)
    x = torch.randn(3, 32)
    q_w, k_w, v_w = torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 32)
    full = F.linear(x, torch.cat([q_w, k_w, v_w]))
    parts = []
    for rank in range(2):
        qkv = QKVParallelLinear(32, 16, 4, 2, tp_size=2, tp_rank=rank)
        for sid, w in zip("qkv", (q_w, k_w, v_w)):
            qkv.weight.weight_loader(qkv.weight, w, sid)
        parts.append(qkv(x).split([32, 16, 16], -1))
    for i, size in enumerate((64, 32, 32)):
        ref = full.split([64, 32, 32], -1)[i]
        assert torch.equal(torch.cat([p[i] for p in parts], -1), ref), size

    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    outs = []
    for rank in range(2):
        mlp = MergedColumnParallelLinear(32, [48, 48], tp_size=2, tp_rank=rank)
        mlp.weight.weight_loader(mlp.weight, gate, 0)
        mlp.weight.weight_loader(mlp.weight, up, 1)
        outs.append(mlp(x).chunk(2, -1))
    assert torch.equal(torch.cat([o[0] for o in outs], -1), F.linear(x, gate))
    assert torch.equal(torch.cat([o[1] for o in outs], -1), F.linear(x, up))

    down = torch.randn(32, 96)
    h = torch.randn(3, 96)
    partial = []
    for rank in range(2):
        row = RowParallelLinear(96, 32, tp_size=2, tp_rank=rank)
        row.weight.weight_loader(row.weight, down)
        partial.append(F.linear(h[:, rank * 48:(rank + 1) * 48], row.weight))
    assert torch.allclose(partial[0] + partial[1], F.linear(h, down), atol=1e-5)

    table = torch.randn(10, 4)
    emb = VocabParallelEmbedding(10, 4, tp_size=2, tp_rank=1)
    emb.weight.weight_loader(emb.weight, table)
    assert torch.equal(emb.weight, table[5:])
    with pytest.raises(ValueError, match="expected shape"):
        emb.weight.weight_loader(emb.weight, torch.randn(12, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_torch_linear(dtype, bias):
    from kernels import linear as dense
    from kernels.cpu import has_native_bf16

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    if dtype == torch.bfloat16 and not has_native_bf16():
        # no bf16 dot products: oneDNN refuses to pack bf16 (AVX2) or would emulate it
        # slower than the native kernel (AVX-512 without BF16): the weight stays plain
        # (its fp32 copy can be packed: the next test)
        assert not dense.can_prepack(weight)
        return
    assert dense.can_prepack(weight)
    packed = dense.prepack(weight)
    assert packed.is_mkldnn and not dense.can_prepack(packed)
    # fp32: oneDNN sums in another order; bf16: the same kernel torch calls
    tol = 1e-5 if dtype == torch.float32 else 0.0
    # every batch size runs on one packing (the hint is 16): decode rows, prefills, 3-d
    for shape in [(1, 64), (3, 64), (16, 64), (300, 64), (2, 5, 64)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        with torch.inference_mode():
            ours, ref = dense.linear(x, packed, b), F.linear(x, weight, b)
        assert ours.dtype == dtype and ours.shape == ref.shape
        scale = ref.float().abs().max().item()
        assert (ours.float() - ref.float()).abs().max().item() <= tol * scale
    assert not dense.can_prepack(weight.half())  # no fast fp16 path on CPU: reference


def test_a_prepacked_fp32_copy_of_a_bf16_weight_computes_as_the_widened_linear():
    """Where bf16 has no dot products, a bf16 weight's prepacked copy is fp32: bf16 rows
    are multiplied in fp32 and rounded once, as `widened_linear` does (oneDNN sums in
    another order than MKL: within one bf16 step); elsewhere no copy is widened."""
    from kernels import linear as dense
    from kernels.cpu import has_native_bf16

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    if has_native_bf16() or not dense.packs_dtype(torch.float32):
        assert not dense.can_prepack_widened(weight)
        return
    assert dense.can_prepack_widened(weight) and not dense.can_prepack(weight)
    assert not dense.can_prepack_widened(weight.float())
    packed = dense.prepack(weight)
    assert packed.is_mkldnn and packed.dtype == torch.float32
    assert not dense.can_prepack_widened(packed)
    for b in (None, bias):
        for shape in [(1, 64), (17, 64), (300, 64), (2, 5, 64)]:
            x = torch.randn(*shape, generator=gen).bfloat16()
            with torch.inference_mode():
                got = dense.linear(x, packed, b)
                want = dense.widened_linear(x.reshape(-1, 64), weight, b).reshape(got.shape)
            assert got.dtype == torch.bfloat16 and got.shape == (*shape[:-1], 96)
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
            assert (got != want).float().mean() <= 0.02


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_a_widened_bf16_linear_rounds_as_torch_bf16_linear(rows, monkeypatch):
    """fp32 sums of the widened weight, rounded once: within one bf16 step of torch's bf16
    `linear` (the same sums in another order), and `linear` takes this path exactly where
    the CPU has no bf16 dot products (AVX2, or AVX-512 without BF16)."""
    from kernels import linear as dense

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 200, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 200, generator=gen).bfloat16()
    for b in (None, bias):
        got, want = dense.widened_linear(x, weight, b), F.linear(x, weight, b)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert torch.allclose(got.double(), exact, rtol=2 ** -8, atol=1e-2)
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
        assert (got != want).float().mean() <= 0.02
    for native_bf16 in (True, False):
        monkeypatch.setattr(dense, "has_native_bf16", lambda value=native_bf16: value)
        chosen = dense.linear(x, weight, bias)
        widened = not native_bf16 and rows >= dense.WIDEN_ROWS  # few: torch's bf16 linear
        path = dense.widened_linear(x, weight, bias) if widened else F.linear(x, weight, bias)
        assert torch.equal(chosen, path)


def test_prepack_linears_swaps_weights_in_place_once(tiny_qwen3_tied_dir):
    from kernels import linear as dense
    from workers.engine.loader import load_checkpoint
    from workers.engine.models.layers import prepack_linears

    bf16 = torch.empty(2, 2, dtype=torch.bfloat16)
    dtype = "bfloat16" if dense.can_prepack(bf16) else "float32"
    loaded = load_checkpoint(tiny_qwen3_tied_dir, dtype=dtype)
    model = loaded.model
    ids = torch.tensor([5, 6, 7])
    with torch.inference_mode():
        hidden = model.model.embed_tokens(ids)
        before = model.compute_logits(hidden)
        num_params = sum(p.numel() for p in model.parameters())
        linears = [m for m in model.modules() if hasattr(m, "prepack")]
        assert prepack_linears(model) == len(linears)
        assert prepack_linears(model) == 0  # a second call changes nothing
        # the tied embedding stays a plain parameter, read by lookups
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert not model.model.embed_tokens.weight.is_mkldnn
        assert torch.equal(model.model.embed_tokens(ids), hidden)
        after = model.compute_logits(hidden)
        if dtype == "bfloat16":  # the same oneDNN kernel torch's bf16 linear calls
            assert torch.equal(after, before)
        else:  # fp32: oneDNN sums in another order
            assert torch.allclose(after, before, rtol=1e-5, atol=1e-4)
        # the plain projection weights are gone, not kept beside their packed copies
        packed = sum(b.numel() for b in model.buffers() if b.is_mkldnn)
        assert packed and sum(p.numel() for p in model.parameters()) == num_params - packed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_times_both_linear_paths_at_start_up_and_takes_the_faster(
        tiny_qwen3_tied_dir, dtype, monkeypatch):
    from kernels import linear as dense
    from kernels.linear import choose_plan, plain_rows_limit, probe_batch_sizes
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner
    from workers.engine.models.layers import probe_weights

    loaded = load_checkpoint(tiny_qwen3_tied_dir, dtype=dtype)
    shapes = [tuple(w.shape) for w in probe_weights(loaded.model)]
    # every projection of every layer (qkv, o, gate/up, down) and the LM head: a pass
    # streams the weights as a step does
    assert len(shapes) == 4 * loaded.config.num_layers + 1 and len(set(shapes)) == 5
    # under a byte budget: the first layers, and one weight of each shape still
    few = probe_weights(loaded.model, max_bytes=1)
    assert len(few) == len({tuple(w.shape) for w in few}) == 5
    monkeypatch.setenv("LLMQ_LINEAR_PATH", "auto")
    runner = ModelRunner(loaded, kv_cache_bytes=1 << 20)
    probe = runner.linear_probe
    weight = torch.empty(2, 2, dtype=getattr(torch, dtype))
    assert set(probe) == set(probe_batch_sizes([weight]))
    packed = [b for b in loaded.model.buffers() if b.is_mkldnn]
    plan = choose_plan(probe)
    if not (dense.can_prepack(weight) or runner.widen and dense.can_prepack_widened(weight)):
        # nothing to pack here (bf16 without bf16 dot products, with no memory for fp32
        # copies): torch's linear and the native kernel are timed
        assert all("prepacked" not in t for t in probe.values()) and not packed
        assert runner.linear_path == plan.name and plan.name in ("native", "reference")
        return
    ratios = {m: t["prepacked"] / t["reference"] for m, t in probe.items()}
    if plan.skinny_rows:  # the native kernel's own test covers this plan
        assert runner.linear_path == "native"
    elif (split := plain_rows_limit(ratios)) is not None:
        assert runner.linear_path == "split" and runner.plain_rows == split and not packed
        assert probe_weights(loaded.model) == []  # every projection has its packed copy
    elif sum(ratios.values()) < len(ratios):
        assert runner.linear_path == "prepacked" and packed
        assert probe_weights(loaded.model) == []
    else:
        assert runner.linear_path == "reference" and not packed
    # forced either way, no timing
    forced = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype=dtype),
                         kv_cache_bytes=1 << 20, linear_path="reference")
    assert forced.linear_path == "reference" and forced.linear_probe == {}


def test_the_ranks_of_a_cpu_group_share_the_memory_for_fp32_copies(tiny_qwen3_tied_dir,
                                                                     monkeypatch):
    """Ranks on one host decide on fp32 copies at once, each after its own load: with two,
    each shard's copies may take half the share of the memory available (the decision
    alone, on any CPU: which weights are widened is the CPU's)."""
    from kernels import linear as dense
    from workers.engine import model_runner
    from workers.engine.loader import load_checkpoint

    monkeypatch.setattr(dense, "can_prepack_widened", lambda weight: True)
    model = load_checkpoint(tiny_qwen3_tied_dir, dtype="bfloat16").model
    weights = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, model_runner.LinearBase | model_runner.ParallelLMHead)}
    copies = 2 * sum(w.numel() * w.element_size() for w in weights.values())
    share = model_runner.WIDENED_COPIES_MEMORY_SHARE
    for available, ranks, fits in ((int(copies / share) + 1024, 1, True),
                                   (int(copies / share) + 1024, 2, False),
                                   (int(2 * copies / share) - 1024, 2, False),
                                   (int(2 * copies / share) + 1024, 2, True)):
        monkeypatch.setattr(model_runner, "available_memory", lambda a=available: a)
        assert model_runner.widened_copies_fit(model, ranks_on_host=ranks) is fits, ranks


def test_bf16_weights_get_fp32_copies_only_where_they_fit_in_memory(
        tiny_qwen3_tied_dir, monkeypatch):
    """Without bf16 dot products, a plan that prepacks gives bf16 weights fp32 copies
    beside the plain ones, while those copies take at most the set share of the memory
    available; then logits stay within bf16 rounding of torch's paths."""
    from kernels import linear as dense
    from workers.engine import model_runner
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner
    from workers.engine.models.layers import LinearBase, ParallelLMHead

    loaded = load_checkpoint(tiny_qwen3_tied_dir, dtype="bfloat16")
    assert not model_runner.widened_copies_fit(
        load_checkpoint(tiny_qwen3_tied_dir, dtype="float32").model)
    if not dense.can_prepack_widened(torch.empty(2, 2, dtype=torch.bfloat16)):
        assert not model_runner.widened_copies_fit(loaded.model)  # nothing to widen here
        return
    layers = [m for m in loaded.model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    copies = 2 * sum(w.numel() * 2 for w in {id(m.weight): m.weight for m in layers}.values())
    share = model_runner.WIDENED_COPIES_MEMORY_SHARE
    for available, fits in ((None, False), (int(copies / share) - 1024, False),
                            (int(copies / share) + 1024, True)):
        monkeypatch.setattr(model_runner, "available_memory", lambda a=available: a)
        assert model_runner.widened_copies_fit(loaded.model) is fits
    ids = torch.tensor([5, 6, 7] * 12)
    with torch.inference_mode():
        hidden = loaded.model.model.embed_tokens(ids)
        want = loaded.model.compute_logits(hidden)  # torch's paths
        monkeypatch.setattr(model_runner, "available_memory", lambda: 0)
        runner = ModelRunner(loaded, kv_cache_bytes=1 << 20, linear_path="native")
        assert not runner.widen and runner.widened_weights == 0
        assert all(m.packed_weight is None and not m.weight.is_mkldnn for m in layers)

        loaded = load_checkpoint(tiny_qwen3_tied_dir, dtype="bfloat16")
        layers = [m for m in loaded.model.modules()
                  if isinstance(m, LinearBase | ParallelLMHead)]
        monkeypatch.setattr(model_runner, "available_memory", lambda: 1 << 40)
        runner = ModelRunner(loaded, kv_cache_bytes=1 << 20, linear_path="native")
        assert runner.widen and runner.widened_weights == len(layers)
        # the plain bf16 weights stay for the native kernel's rows
        assert all(m.weight.dtype == torch.bfloat16 and not m.weight.is_mkldnn
                   and m.packed_weight.dtype == torch.float32 for m in layers)
        got = loaded.model.compute_logits(hidden)  # 36 rows: the fp32 copy
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)


def test_bf16_decodes_equal_fp32_attention_within_bf16_rounding():
    """bf16 caches: grouped and single decodes (the latter computed in fp32 on CPU) give
    bf16 rows within bf16 rounding of fp32 attention over the same values."""
    torch.manual_seed(7)
    block_size = 8
    lens = [30, 31, 29, 5, 70]  # one group of three, two singles
    kv_cache = torch.randn(40, 2, 1, block_size, 2, 16).bfloat16()
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 1, 0]
    free = list(range(40))
    random.Random(7).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = build_attention_metadata(kv_cache, [(n - 1, 1, t) for n, t in zip(lens, tables)])
    assert len(meta.decodes.groups) == 1 and meta.decodes.singles == [3, 4]
    q = torch.randn(len(lens), 4, 16).bfloat16()
    out = kernels.paged_attention(q, None, None, k_cache, v_cache, meta)
    assert out.dtype == torch.bfloat16
    for i, (table, n) in enumerate(zip(tables, lens)):
        keys = k_cache[table].flatten(0, 1)[:n].float()
        values = v_cache[table].flatten(0, 1)[:n].float()
        ref = _dense_attention(q[i:i + 1].float(), keys, values, n - 1)
        assert torch.allclose(out[i:i + 1].float(), ref, atol=2e-2, rtol=2e-2), n


def test_fresh_prompts_of_equal_length_attend_as_one_batch():
    """Adjacent fresh prompts of the same length merge into one chunk (one batched causal
    call); a prompt of another length, or after a decode, starts a new chunk. Each row
    equals dense causal attention over its own prompt."""
    torch.manual_seed(8)
    block_size = 4
    kv_cache = torch.zeros(64, 2, 1, block_size, 2, 16)
    lens = [6, 6, 6, 5, 1, 6]  # the 1 is a decode after 9 cached tokens
    spans, next_block = [], 0
    for n in lens:
        start = 9 if n == 1 else 0
        num_blocks = -(-(start + n) // block_size)
        spans.append((start, n, list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    meta = build_attention_metadata(kv_cache, spans)
    assert [(c.token_start, c.num_tokens, c.num_seqs) for c in meta.chunks] == [
        (0, 6, 3), (18, 5, 1), (24, 6, 1)]
    num_tokens = sum(lens)
    q = torch.randn(num_tokens, 4, 16)
    k, v = torch.randn(num_tokens, 2, 16), torch.randn(num_tokens, 2, 16)
    k_cache, v_cache = kv_cache[:, 0, 0], kv_cache[:, 1, 0]
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
    out = kernels.paged_attention(q, k, v, k_cache, v_cache, meta)
    row = 0
    for n in lens:
        if n > 1:
            rows = slice(row, row + n)
            ref = _dense_attention(q[rows], k[rows], v[rows], 0)
            assert torch.allclose(out[rows], ref, atol=1e-5), n
        row += n


@pytest.mark.parametrize("value, path", [("prepacked", "prepacked"), ("reference", "reference"),
                                         ("split", "split"), ("native", "native")])
def test_linear_path_setting_pins_the_path_without_timing(tiny_qwen3_tied_dir, monkeypatch,
                                                          value, path):
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    monkeypatch.setenv("LLMQ_LINEAR_PATH", value)
    runner = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                         kv_cache_bytes=1 << 20)
    assert runner.linear_path == path and runner.linear_probe == {}


def test_a_linear_path_setting_of_no_known_path_is_refused(tiny_qwen3_tied_dir, monkeypatch):
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    monkeypatch.setenv("LLMQ_LINEAR_PATH", "fastest")
    with pytest.raises(ValueError, match="LLMQ_LINEAR_PATH='fastest'"):
        ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                    kv_cache_bytes=1 << 20)


@pytest.mark.parametrize("ratios, limit", [
    ({1: 1.2, 4: 1.05, 16: 0.7}, 4),  # torch's linear wins up to 4 rows: split there
    ({1: 1.2, 4: 0.9, 16: 0.7}, 1),
    ({1: 0.7, 4: 0.8, 16: 0.6}, None),  # prepacked wins everywhere
    ({1: 1.3, 4: 1.1, 16: 1.2}, None),  # torch's linear wins everywhere
    ({1: 1.2, 4: 0.9, 16: 1.1}, None),  # no single crossover: no split
    ({1: 0.9, 4: 1.1, 16: 1.2}, None),  # prepacked only at few rows: no split
])
def test_a_split_is_taken_only_at_one_crossover_from_torch_linear_to_prepacked(ratios, limit):
    from kernels.linear import plain_rows_limit

    assert plain_rows_limit(ratios) == limit


def test_a_split_layer_computes_few_rows_with_the_plain_weight_and_more_with_the_packed(
        tiny_qwen3_tied_dir):
    from kernels import linear as dense
    from workers.engine.loader import load_checkpoint
    from workers.engine.models.layers import LinearBase, ParallelLMHead

    model = load_checkpoint(tiny_qwen3_tied_dir, dtype="float32").model
    # one layer of each kind: the column, merged, qkv and row-parallel projections
    layers = list({type(m): m for m in model.modules() if isinstance(m, LinearBase)}.values())
    assert len(layers) >= 3
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    weights = [layer.weight.detach().clone() for layer in layers]
    head_weight = head.weight.detach().clone()
    assert all(layer.prepack(plain_rows=2) for layer in layers) and head.prepack(plain_rows=2)
    assert all(not layer.weight.is_mkldnn and layer.packed_weight.is_mkldnn
               for layer in layers)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 2, 3, 8):
            h = torch.randn(rows, head_weight.shape[1], generator=gen)
            for layer, weight in zip(layers, weights):
                x = torch.randn(rows, weight.shape[1], generator=gen)
                want = (torch.nn.functional.linear(x, weight) if rows <= 2
                        else dense.linear(x, dense.prepack(weight)))
                assert torch.equal(layer(x), want), (type(layer).__name__, rows)
            if rows <= 2:
                assert torch.equal(head.compute_logits(h), h @ head_weight.T)
            else:
                assert torch.equal(head.compute_logits(h),
                                   dense.linear(h, dense.prepack(head_weight)))
