"""The split-KV decoding kernel and the KV-cache offset helpers against the float64 reference."""
from __future__ import annotations

import math

import pytest
import torch

from flexcore import BlockMask, create_block_mask, flex_attention
from flexcore.attention import kv_blocks
from flexcore.decoding import offset_mask_mod, offset_score_mod
from flexcore.errors import InputError
from flexcore.kernels import codegen
from flexcore.kernels.decode import DecodePlan, choose_num_splits, decode, plan_decode
from flexcore.lowering import lower_mask_mod, lower_score_mod
from flexcore.options import KernelOptions
from flexcore.reference import flex_attention_reference
from tests.flexcore.cases import MOD_NAMES, Shape, make_case, make_mods
from tests.flexcore.compare import assert_matches_reference, rel_err, seed_of
from tests.flexcore.helpers import check_decode, run_decode, shape_spy

DEVICE = "cpu"


# Why these shapes: S=300 leaves a ragged last key block; 8 query heads on 2 KV heads packs a GQA
# group of 4 into each tile; q_len 7 is not a power of two (rows = 4 heads x 7 positions = 28).
def decode_shape(L: int, **kw) -> Shape:
    fields = dict(name=f"decode_q{L}", B=2, Hq=8, Hkv=2, L=L, S=300, D=32, Dv=32, block=64)
    fields.update(kw)
    return Shape(**fields)


@pytest.mark.parametrize("L", [1, 2, 7])
@pytest.mark.parametrize("mod_name", MOD_NAMES)
def test_decode_variants(mod_name, L):
    check_decode(decode_shape(L), mod_name, torch.float32, seed=seed_of(mod_name, L))


@pytest.mark.parametrize("mod_name", ["causal", "alibi", "document"])
def test_decode_bf16(mod_name):
    check_decode(decode_shape(2), mod_name, torch.bfloat16, seed=seed_of(mod_name, "bf16"))


def test_decode_fp16_odd_head_dims():
    # D=80 and Dv=48 pad to 128 / 64 lanes; S=256 is a whole number of key blocks (no ragged edge).
    shape = decode_shape(3, D=80, Dv=48, S=256, Hq=6, Hkv=3)
    check_decode(shape, "alibi", torch.float16, seed=11)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 12])
def test_decode_split_counts(num_splits):
    # 5 key blocks split 12 ways leaves empty splits; sliding_window lists few blocks per row.
    check_decode(decode_shape(2), "sliding_window", torch.float32, seed=seed_of("split", num_splits),
                 num_splits=num_splits)


def test_decode_split_combination():
    # The last split of each tile combines the partials: the result matches the reference, and
    # the counters are back at zero for the next call.
    from flexcore.kernels import decode as decode_mod

    for step in range(2):  # a second call finds the counters the first one left
        check_decode(decode_shape(4, Hq=8, Hkv=2), "alibi", torch.float32,
                     seed=seed_of("combine", step), num_splits=3)
    assert decode_mod._counters
    assert all(int(buf.abs().sum()) == 0 for buf in decode_mod._counters.values())


def test_decode_fully_masked_rows():
    # Batch 0 keeps no key at all: its rows must come out 0 with lse -inf, never NaN.
    gen = torch.Generator().manual_seed(7)
    shape = decode_shape(2, B=2)
    q, k, v = shape.qkv(torch.float32, DEVICE, gen)
    limit = torch.tensor([0, 150])

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < limit[b]

    bm = create_block_mask(prefix, 2, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=64)
    out, lse = run_decode(q, k, v, None, bm, num_splits=3)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert bool((lse[0] == -math.inf).all())
    assert_matches_reference(q, k, v, None, bm, out, lse, "fully masked batch 0")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_output_keeps_the_query_order(num_splits):
    # A (B, L, H, D) query viewed as (B, H, L, D) (a projection's output): the output has the same
    # stride order, as torch's flex_attention's, written by one split or by the merge of several.
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    gen = torch.Generator().manual_seed(seed_of("decode_order", num_splits))
    shape = decode_shape(4)
    q, k, v = shape.qkv(torch.float32, DEVICE, gen)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    out, lse = run_decode(q, k, v, None, None, num_splits=num_splits)
    assert out.stride() == torch_flex(q, k, v, enable_gqa=True).stride() == q.stride()
    assert_matches_reference(q, k, v, None, None, out, lse, "query order")


def test_decode_float64_runs_the_forward_kernel():
    # The decode kernel accumulates in float32: float64 inputs take the forward kernel, float64
    # throughout, to rounding of the reference.
    shape = decode_shape(2)
    q, k, v, score_mod, bm = make_case(shape, "alibi", torch.float64, seed_of("decode_f64"), DEVICE)
    out, lse = decode(q, k, v, lower_score_mod(score_mod, torch.float64), lower_mask_mod(bm.mask_mod),
                      kv_blocks(bm, shape.B, shape.Hq), 0.3, KernelOptions())
    gold, gold_lse = flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, scale=0.3,
                                              enable_gqa=True, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64
    assert rel_err(out, gold) <= 1e-12 and rel_err(lse, gold_lse) <= 1e-12


def test_decode_per_head_block_mask():
    # The mask differs by head, so the BlockMask lists per-head blocks: heads cannot share a tile.
    gen = torch.Generator().manual_seed(8)
    shape = decode_shape(2, S=320)
    q, k, v = shape.qkv(torch.float32, DEVICE, gen)
    windows = torch.tensor([16, 64, 200, 320, 30, 100, 5, 250])

    def per_head_window(b, h, q_idx, kv_idx):
        return (shape.S - shape.L + q_idx - kv_idx).abs() < windows[h]

    bm = create_block_mask(per_head_window, None, shape.Hq, shape.L, shape.S, device=DEVICE,
                           BLOCK_SIZE=64)
    plan = plan_decode(shape.B, shape.Hq, shape.Hkv, shape.L, shape.S,
                       kv_blocks(bm, shape.B, shape.Hq), torch.device(DEVICE))
    assert plan.heads_per_tile == 1
    out, lse = run_decode(q, k, v, None, bm)
    assert_matches_reference(q, k, v, None, bm, out, lse, "per-head mask")


@pytest.mark.parametrize("block_n", [None, 32])
def test_decode_tiles_within_mask_blocks(block_n):
    # Key blocks of 128 are visited in 2 (BLOCK_N 64) or 4 (BLOCK_N 32) tiles each.
    shape = decode_shape(3, block=128)
    gen = torch.Generator().manual_seed(seed_of("tiles", block_n))
    q, k, v = shape.qkv(torch.float32, DEVICE, gen)
    score_mod, mask_mod = make_mods("document", shape, DEVICE, gen)
    bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=128)
    out, lse = run_decode(q, k, v, score_mod, bm, num_splits=2, opts=KernelOptions(BLOCK_N=block_n))
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, f"BLOCK_N {block_n}")


def test_decode_query_longer_than_mask_block():
    # 20 query positions over query blocks of 16: two chunks, each reading its own block row.
    shape = decode_shape(20, Hq=4, block=(16, 64))
    check_decode(shape, "causal", torch.float32, seed=9)


def test_decode_plan_packs_gqa_group():
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 1, 8192,
                           device=DEVICE)
    plan = plan_decode(8, 32, 8, 1, 8192, kv_blocks(bm, 8, 32), torch.device(DEVICE), num_splits=4)
    assert plan == DecodePlan(heads_per_tile=4, q_per_tile=1, q_chunks=1, block_m=16, num_splits=4)
    with pytest.raises(InputError, match="num_splits"):
        plan_decode(8, 32, 8, 1, 8192, kv_blocks(bm, 8, 32), torch.device(DEVICE), num_splits=0)


def test_choose_num_splits_fills_the_gpu():
    # 64 tiles (B=8, Hkv=8) on 132 SMs: 4 splits give 256 programs, two rounds of equal work.
    assert choose_num_splits(64, 64, 132) == 4
    for tiles in (1, 8, 64, 100, 512):
        s = choose_num_splits(tiles, 64, 132)
        best = min(math.ceil(tiles * t / 132) / t for t in range(1, 65))
        assert math.ceil(tiles * s / 132) / s <= 1.05 * best
    assert choose_num_splits(8, 3, 132) <= 3


# -- KV-cache offsets ---------------------------------------------------------------------------

def _shifted_reference_mods(offsets, slopes):
    def causal(b, h, q_idx, kv_idx):
        return q_idx + offsets[b] >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offsets[b] - kv_idx).abs()

    return causal, alibi


@pytest.mark.parametrize("offset_shape", ["0d", "1", "B"])
def test_offsets_match_absolute_positions(offset_shape):
    gen = torch.Generator().manual_seed(seed_of("offset", offset_shape))
    shape = decode_shape(2, B=2, S=256)
    q, k, v = shape.qkv(torch.float32, DEVICE, gen)
    slopes = torch.rand(shape.Hq, generator=gen)
    values = {"0d": [100, 100], "1": [130, 130], "B": [60, 200]}[offset_shape]
    offset = {"0d": torch.tensor(values[0]), "1": torch.tensor(values[:1]),
              "B": torch.tensor(values)}[offset_shape]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    mask_mod, score_mod = offset_mask_mod(causal, offset), offset_score_mod(alibi, offset)
    assert mask_mod.__name__ == "offset_causal" and score_mod.__name__ == "offset_alibi"
    bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=64)
    out, lse = run_decode(q, k, v, score_mod, bm)
    # The same attention written with explicit absolute positions.
    ref_mask, ref_score = _shifted_reference_mods(torch.tensor(values), slopes)
    ref_bm = create_block_mask(ref_mask, shape.B, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=64)
    assert_matches_reference(q, k, v, ref_score, ref_bm, out, lse, f"offset {offset_shape}")


def test_changing_offset_does_not_recompile():
    gen = torch.Generator().manual_seed(21)
    shape = decode_shape(1, B=2, S=384)
    q, k, v = shape.qkv(torch.float32, DEVICE, gen)
    slopes = torch.rand(shape.Hq, generator=gen)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    # torch's decoding recipe: one BlockMask over the whole cache, sliced at the current row.
    full = create_block_mask(causal, None, None, shape.S, shape.S, device=DEVICE, BLOCK_SIZE=64)
    offset = torch.tensor(0)
    mask_mod, score_mod = offset_mask_mod(causal, offset), offset_score_mod(alibi, offset)
    compiles = None
    for pos in (5, 70, 200, 383):
        offset.fill_(pos)
        bm = full[:, :, pos // 64].with_mask_mod(mask_mod, seq_lengths=(1, shape.S))
        out, lse = run_decode(q, k, v, score_mod, bm)
        if compiles is None:
            compiles = codegen.compile_count
        assert codegen.compile_count == compiles, f"recompiled at offset {pos}"
        ref_mask, ref_score = _shifted_reference_mods(torch.tensor([pos, pos]), slopes)
        ref_bm = create_block_mask(ref_mask, None, None, 1, shape.S, device=DEVICE, BLOCK_SIZE=64)
        assert_matches_reference(q, k, v, ref_score, ref_bm, out, lse, f"offset {pos}")


def test_offset_errors():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    with pytest.raises(InputError, match="integer torch.Tensor"):
        offset_mask_mod(causal, 5)
    with pytest.raises(InputError, match="integer dtype"):
        offset_mask_mod(causal, torch.tensor(5.0))
    with pytest.raises(InputError, match=r"\(B,\)"):
        offset_score_mod(lambda s, b, h, q, kv: s, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(InputError, match="callable"):
        offset_mask_mod(None, torch.tensor(1))


def test_flex_attention_switches_to_decode(monkeypatch):
    # flex_attention must route short queries to the decode kernel by itself (kernel_options
    # decode=None) and when forced (decode=True), with the same result as a direct call.
    import flexcore.kernels.decode as decode_module

    calls = shape_spy(monkeypatch, decode_module, "decode")
    gen = torch.Generator().manual_seed(31)
    shape = decode_shape(1)
    q, k, v = shape.qkv(torch.float32, DEVICE, gen)
    score_mod, mask_mod = make_mods("alibi", shape, DEVICE, gen)
    bm = create_block_mask(mask_mod, None, None, shape.L, shape.S, device=DEVICE, BLOCK_SIZE=64)
    for options in (None, {"decode": True}):
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                             kernel_options=options)
        gold = flex_attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
        assert rel_err(out, gold) < 1e-5
    assert len(calls) == 2, "flex_attention did not call flexcore.kernels.decode.decode"


# -- GPU (run with -m gpu on the device) ----------------------------------------------------------

GPU_DECODE = [
    Shape("decode_8k", B=8, Hq=32, Hkv=8, L=1, S=8192, D=128, Dv=128, block=128),
    Shape("decode_64k", B=8, Hq=32, Hkv=8, L=1, S=65536, D=128, Dv=128, block=128),
    Shape("decode_q7_ragged", B=2, Hq=16, Hkv=4, L=7, S=5000, D=128, Dv=128, block=128),
    Shape("decode_d80", B=2, Hq=8, Hkv=2, L=3, S=3000, D=80, Dv=48, block=128),
]


# cases.make_mods("document") draws about S/6 tokens per position before truncating: kept to S <= 8k.
GPU_DECODE_CASES = [(shape, mod) for shape in GPU_DECODE for mod in MOD_NAMES
                    if not (mod == "document" and shape.S > 8192)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape,mod_name", GPU_DECODE_CASES, ids=lambda x: getattr(x, "name", x))
def test_decode_gpu(shape, mod_name):
    check_decode(shape, mod_name, torch.bfloat16, seed=seed_of(mod_name, shape.name), device="cuda")


# Decoding speed is measured by the benchmark, side by side with SDPA and torch flex in one run:
# `python -m bench run --config decode` (docs/decisions.md), not by timed tests.


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_step_replays_in_a_cuda_graph():
    """A decoding step captured once in a CUDA graph (the way inference loops run) gives the
    reference result at every replay, with the query and the offset tensor updated in place."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed_of("graph"))
    B, Hq, Hkv, S, D = 2, 8, 2, 4096, 128
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16, generator=gen)
    slopes = torch.rand(Hq, device=dev, generator=gen)
    offset = torch.tensor([0, 0], device=dev)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    mask_mod, score_mod = offset_mask_mod(causal, offset), offset_score_mod(alibi, offset)
    # Every key block is listed as partial (the mask_mod decides), so one BlockMask, at fixed
    # addresses, serves every offset.
    n = S // 128
    bm = BlockMask.from_kv_blocks(torch.full((1, 1, 1), n, dtype=torch.int32, device=dev),
                                  torch.arange(n, dtype=torch.int32, device=dev).view(1, 1, 1, n),
                                  mask_mod=mask_mod, seq_lengths=(1, S))

    def step():
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                              return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and autotune outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for positions in ([100, 3000], [4095, 17], [1, 2048]):
        offset.copy_(torch.tensor(positions, device=dev))
        q.copy_(torch.randn(q.shape, device=dev, dtype=q.dtype, generator=gen))
        graph.replay()
        ref_mask, ref_score = _shifted_reference_mods(offset.clone(), slopes)
        ref_bm = create_block_mask(ref_mask, B, None, 1, S, device=dev)
        assert_matches_reference(q, k, v, ref_score, ref_bm, out.clone(), lse.clone(),
                                 f"replay at offsets {positions}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("L", [1, 20, 32], ids=["decode", "forward", "backward"])
def test_tables_that_cover_more_than_the_lengths(L, compiled):
    """The FlexDecoding recipe on a mask made for a longer sequence than the call's: rows sliced,
    mask_mod and seq_lengths assigned, and the tables still list blocks past KV_LEN (a multiple
    of the block size, so the kernels do not bound their loads by it). The kernels read a mask
    without them (BlockMask._within): they read past K/V, and past Q in the backward, before.
    Against float64, gradients included."""

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed_of("tables_past_lengths", L, compiled))
    S = 64
    full = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, None, None, 128, 128,
                             device="cpu", BLOCK_SIZE=16)
    bm = full[:, :, 0:-(-L // 16)]
    bm.mask_mod = lambda b, h, q_idx, kv_idx: q_idx + (S - L) >= kv_idx
    bm.seq_lengths = (L, S)
    q = torch.randn(1, 2, L, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 16, generator=gen, requires_grad=True) for _ in range(2))
    weights = torch.randn(1, 2, L, 16, generator=gen)

    def call(q, k, v):
        return flex_attention(q, k, v, block_mask=bm)

    fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
    out = fn(q, k, v)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    gold = flex_attention_reference(q, k, v, block_mask=bm)
    gold_grads = torch.autograd.grad((gold * weights).sum(), (q, k, v))
    torch.testing.assert_close(out, gold.float(), rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, gold_grads):
        torch.testing.assert_close(got, expected.float(), rtol=1e-4, atol=1e-4)
