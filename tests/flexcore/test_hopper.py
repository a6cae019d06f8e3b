"""The Gluon forward for Hopper (flexcore.kernels.hopper): where it applies, and on an sm_90 GPU
its outputs and gradients against the float64 reference (GPU tests marked `gpu`)."""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

from flexcore import AuxRequest, KernelOptions, create_block_mask, flex_attention, noop_mask
from flexcore.errors import KernelFallbackWarning
from flexcore.kernels import hopper
from flexcore.kernels.forward import output_strides
from flexcore.kernels.policy import DEFAULT_POLICY
from tests.flexcore.cases import Shape
from tests.flexcore.compare import assert_matches_reference, seed_of
from tests.flexcore.policies import policy_options
from tests.flexcore.helpers import (check_backward, check_lse_grads, kernel_grads, needs_hopper, served_spy,
                                    shape_spy)


# --- the layout check, on any machine ---

@pytest.mark.parametrize("layout, expected", [
    ("contiguous", (2 * 3 * 256, 3 * 256, 256)),
    ("head_slice", (6 * 256 + 2 * 512 + 256, 6 * 256, 512)),  # every other head of 6
    ("bshd", None),  # (B, S, H, D) transposed: the head stride is not a multiple of the row stride
    ("padded_rows", (2 * 3 * 256, 3 * 256, 256)),  # row stride 136 elements (272 bytes)
    ("odd_row_stride", None),  # row stride of 129 elements is not 16-byte aligned
    ("last_dim_strided", None),
    ("overlapping_rows", None),  # row stride below D
    ("size1_dims", (256, 0, 0)),  # B = H = 1: their strides are never stepped, whatever they are
])
def test_rows_view(layout, expected):
    B, H, N, D = 2, 3, 256, 128
    if layout == "contiguous":
        t = torch.zeros(B, H, N, D, dtype=torch.bfloat16)
    elif layout == "head_slice":
        t = torch.zeros(B, 2 * H, N, D, dtype=torch.bfloat16)[:, ::2]
    elif layout == "bshd":
        t = torch.zeros(B, N, H, D, dtype=torch.bfloat16).transpose(1, 2)
    elif layout == "padded_rows":
        t = torch.zeros(B, H, N, 136, dtype=torch.bfloat16)[..., :D]
    elif layout == "odd_row_stride":
        t = torch.zeros(B, H, N, 129, dtype=torch.bfloat16)[..., :D]
    elif layout == "last_dim_strided":
        t = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)[..., ::2]
    elif layout == "overlapping_rows":
        t = torch.zeros(B * H * N * D, dtype=torch.bfloat16).as_strided((B, H, N, D), (H * N * 64, N * 64, 64, 1))
    else:
        B = H = 1
        t = torch.zeros(3, N, D, dtype=torch.bfloat16).as_strided((1, 1, N, D), (77, 5, D, 1))
    got = hopper._rows(t)
    if expected is None:
        assert got is None
    else:
        assert got == expected
        rows, rb, rh = got
        # the last (batch, head)'s last row is the last row the view spans
        assert (B - 1) * rb + (H - 1) * rh + N - 1 == rows - 1


@pytest.mark.parametrize("layout, served", [
    ("contiguous", True), ("head_slice", True), ("padded_rows", True),
    ("hbsd", False),  # heads outermost: the output in that order is not one (rows, D) matrix
    ("bshd", False), ("size1_dims", True)])
def test_output_in_the_query_order_is_contiguous(layout, served):
    # The Gluon forwards write the output through one descriptor over B * H * L rows; the output
    # keeps the query's stride order (as torch's flex_attention), so other orders take the template.
    B, H, N, D = 2, 3, 256, 128
    if layout == "contiguous":
        t = torch.zeros(B, H, N, D)
    elif layout == "head_slice":
        t = torch.zeros(B, 2 * H, N, D)[:, ::2]
    elif layout == "padded_rows":
        t = torch.zeros(B, H, N, 136)[..., :D]
    elif layout == "hbsd":
        t = torch.zeros(H, B, N, D).transpose(0, 1)
    elif layout == "bshd":
        t = torch.zeros(B, N, H, D).transpose(1, 2)
    else:
        t = torch.zeros(3, N, D).as_strided((1, 1, N, D), (77, 5, D, 1))
    assert hopper._output_contiguous(t) == served


def test_a_first_launch_that_fails_leaves_the_kernel_to_the_template(monkeypatch):
    # A Gluon compile error (an experimental API another triton may change, a mod Gluon does not
    # take) on the first launch of a kernel is reported, not raised, remembered with its reason and
    # warned about once; a kernel that launched once is not guarded again, so later errors surface.
    monkeypatch.setattr(hopper, "_unsupported", {})
    monkeypatch.setattr(hopper, "_compiled", set())
    ran = []

    def failing():
        ran.append("failing")
        raise RuntimeError("PassManager::run failed\nmore lines")

    with pytest.warns(KernelFallbackWarning, match=r"Gluon masked forward .*PassManager::run failed.*template"):
        assert hopper._launch_once("a", failing, "masked forward") is False
    assert hopper.fallbacks() == {"a": "RuntimeError: PassManager::run failed"}
    assert "a" not in hopper._compiled
    assert hopper._launch_once("b", lambda: ran.append("ok")) is True
    assert "b" in hopper._compiled
    with pytest.raises(RuntimeError):
        hopper._launch_once("b", failing)
    assert ran == ["failing", "ok", "failing"]
    assert list(hopper.fallbacks()) == ["a"]


def test_kept_reasons_are_found_by_exact_key_and_count_the_calls_they_turn_away(monkeypatch):
    from flexcore.lowering import lower_mask_mod
    monkeypatch.setattr(hopper, "_unsupported", {})
    monkeypatch.setattr(hopper, "_declined", collections.Counter())
    mask = lower_mask_mod(lambda b, h, qi, ki: ki <= qi)
    failed = hopper.masked_forward_key(mask, torch.bfloat16, 128)
    hopper._unsupported[failed] = "boom"
    assert hopper.kept_reason(failed) == "boom"
    # another dtype, head dim or sinks is another kernel
    for other in (hopper.masked_forward_key(mask, torch.float16, 128), hopper.masked_forward_key(mask, torch.bfloat16, 64),
                  hopper.masked_forward_key(mask, torch.bfloat16, 128, sinks=True),
                  hopper.module_key("forward_hopper.py.tmpl", mask), hopper.dense_key(torch.bfloat16, 128)):
        assert hopper.kept_reason(other) is None and not hopper._turned_away(other)
    assert hopper._turned_away(failed) and hopper._turned_away(failed)
    assert hopper.fallback_counts() == {failed: 2}


def test_a_compile_error_s_reason_is_its_message_and_an_error_filter_keeps_nothing(monkeypatch):
    # triton's CompilationError text starts with the source location; its message is kept apart.
    # Where the warning is made an error, every first launch raises and nothing is remembered.
    monkeypatch.setattr(hopper, "_unsupported", {})
    monkeypatch.setattr(hopper, "_compiled", set())

    class CompilationError(Exception):
        error_message = "unsupported op: gl.frobnicate"

    def failing():
        raise CompilationError("at 66:19:\n    x = gl.frobnicate(y)\n        ^\nunsupported op: gl.frobnicate")

    def nested():  # as triton wraps an error inside a called jit function: no message of its own
        try:
            try:
                raise NameError("name 'fl_x' is not defined\nsecond line")
            except NameError as inner:
                raise CompilationError("at 3:4:\n    fl_x(a)") from inner
        except CompilationError as middle:
            outer = CompilationError("at 45:16:\n    _attend(...)")
            outer.error_message = None
            raise outer from middle

    with pytest.warns(KernelFallbackWarning):
        assert hopper._launch_once("a", failing) is False
        assert hopper._launch_once("c", nested) is False
    assert hopper.fallbacks() == {"a": "CompilationError: unsupported op: gl.frobnicate",
                                  "c": "NameError: name 'fl_x' is not defined"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        for _ in range(2):
            with pytest.raises(KernelFallbackWarning):
                hopper._launch_once("b", failing)
    assert "b" not in hopper.fallbacks()


def test_explain_gives_a_kept_failure_before_the_size_rule():
    # A reason is kept only for a kernel the other rules would take, so it comes first; the size
    # rule's text is for calls the Gluon kernels would serve but for their size.
    from flexcore.explain import _gluon_refusal
    from flexcore.kernels.policy import DEFAULT_POLICY as policy
    q = torch.zeros(1, 1, 256, 128, dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(q.__class__, "is_cuda", property(lambda self: True))
        patch.setattr("flexcore._runtime.use_interpreter", lambda: False)
        said = _gluon_refusal(q, q, q, policy, False, True, failed="RuntimeError: boom")
        assert "boom" in said and "masked_min_flops" not in said
        assert "masked_min_flops" in _gluon_refusal(q, q, q, policy, False, True)


def test_out_of_memory_on_a_first_launch_is_raised_not_remembered(monkeypatch):
    # Out of memory or a device error: the template would fail alike; taking it for every later
    # call would hide the error.
    monkeypatch.setattr(hopper, "_unsupported", {})
    monkeypatch.setattr(hopper, "_compiled", set())

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def device_error():  # as triton's launcher reports one
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(torch.cuda.OutOfMemoryError):
            hopper._launch_once("a", out_of_memory)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            hopper._launch_once("b", device_error)
    assert hopper.fallbacks() == {} and not hopper._compiled


def test_a_mask_mod_s_lowering_helpers_come_in_gluon_form(monkeypatch):
    # Floor division and remainder lower to triton.jit helpers, which a Gluon kernel cannot call:
    # the Gluon module carries Gluon forms of them (and of the helpers they call). A helper without
    # one (libdevice's) leaves the mask to the template, quietly: a known limit, not a failure.
    from flexcore.lowering import lower_mask_mod
    monkeypatch.setattr(hopper, "_unsupported", {})
    monkeypatch.setattr(hopper, "_declined", collections.Counter())

    def chunked(b, h, qi, ki):
        return (qi // 96 >= ki // 96) & ((ki - qi) % 7 != 3)

    def atan_bands(b, h, qi, ki):
        return torch.atan(qi.float() - ki.float()) > -1.0

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for build in (hopper.masked_module, hopper.backward_module):
            module = build(lower_mask_mod(chunked))
            assert module is not None
            for helper in ("fl_div_floor_int", "fl_div_trunc_int", "fl_remainder_int"):
                assert type(getattr(module, helper)).__name__ == "GluonJITFunction", helper
        assert hopper.masked_module(lower_mask_mod(atan_bands)) is None
    reasons = set(hopper.fallbacks().values())
    assert len(reasons) == 1 and "fl_atan" in reasons.pop()


def test_not_used_off_the_gpu_or_when_switched_off(monkeypatch):
    from flexcore.lowering import lower_score_mod
    from flexcore.options import KernelOptions
    q = torch.zeros(1, 1, 128, 128, dtype=torch.bfloat16)
    trivial = lower_score_mod(None, torch.float32)
    opts = KernelOptions.from_any(None)
    if not torch.cuda.is_available():  # CPU tensors and the interpreter
        assert not hopper.applies(q, q, q, trivial, True, 0.1, opts)
    opts = policy_options(gluon={"dense": "off"})
    assert not hopper.applies(q, q, q, trivial, True, 0.1, opts)


def test_backward_not_used_off_the_gpu_or_when_switched_off(monkeypatch):
    from flexcore.kernels.forward import BlockTensors
    from flexcore.lowering import lower_score_mod
    from flexcore.options import KernelOptions
    q = torch.zeros(1, 1, 128, 128, dtype=torch.bfloat16)
    trivial = lower_score_mod(None, torch.float32)
    opts = KernelOptions.from_any(None)
    bm = create_block_mask(noop_mask, None, None, 128, 128, device="cpu")
    blocks = BlockTensors.expanded(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                   bm.BLOCK_SIZE, 1, 1)
    if not torch.cuda.is_available():  # CPU tensors and the interpreter
        assert not hopper.applies_backward(q, q, q, q, trivial, blocks, blocks, True, 0.1, opts)
    opts = policy_options(gluon={"backward": "off"})
    assert not hopper.applies_backward(q, q, q, q, trivial, blocks, blocks, True, 0.1, opts)


@pytest.mark.parametrize("D, dense, L, programs, num_wg", [
    (64, True, 4096, 22, 3),  # 21 x 192 + 64 rows: the last program keeps one warpgroup of three
    (64, True, 384, 2, 3),
    (64, False, 4096, 22, 3),  # a mask: programs over two mask blocks (union_tables)
    (128, True, 4096, 32, 2),
    (128, False, 4096, 32, 2),  # a mask: one 128-row block per program
])
def test_gluon_forward_grid_and_tiles(monkeypatch, D, dense, L, programs, num_wg):
    # The host side of the Gluon forwards, on any machine: the grid covers every query row with
    # programs of num_wg warpgroups of 64 rows (at head dim 64: FlashAttention-3's 192), which walk
    # union lists (UNION) where a mask's 128-row blocks do not match them.
    from flexcore.kernels import launch

    launched = []
    monkeypatch.setattr(launch, "run", lambda kernel, grid, args, kwargs, policy: launched.append((grid, args, kwargs)))

    class Module:
        flex_hopper_fwd = object()

    q = torch.zeros(2, 3, L, D, dtype=torch.bfloat16)
    monkeypatch.setattr(hopper, "_prepare", lambda q, k, v: ("result", (None,) * 6, (0,) * 6))
    monkeypatch.setattr(hopper, "_compiled", set())
    monkeypatch.setattr(hopper, "_unsupported", {})
    if dense:
        monkeypatch.setattr(hopper, "dense_module", lambda: Module())
        assert hopper.forward(q, q, q, 0.1) == "result"
    else:
        table_args = (q,) * 4 + (0,) * 12
        assert hopper.forward_masked(q, q, q, Module(), table_args, True, 0.1, (), ("k",)) == "result"
    [(grid, args, kwargs)] = launched
    tiles = (hopper.DENSE_TILES if dense else hopper.MASKED_TILES)[D]
    assert tiles.num_wg == num_wg
    assert grid == (programs, 2 * 3) and (grid[0] - 1) * num_wg * 64 < L <= grid[0] * num_wg * 64
    assert kwargs == dict(DENSE=dense, HAS_FULL_BLOCKS=not dense, HAS_SINKS=False, FP8=False, BLOCK_M=64,
                          BLOCK_N=hopper.BLOCK_N, HEAD_DIM=D, NUM_STAGES=tiles.stages, WG_REGS=tiles.wg_regs,
                          NUM_WG=num_wg, UNION=not dense and num_wg == 3, num_warps=4, maxnreg=tiles.max_regs)


def _union_masks(N: int) -> dict:
    def causal(b, h, qi, ki):
        return ki <= qi

    def sliding(b, h, qi, ki):
        return (ki <= qi) & (qi - ki <= 300)

    def prefix(b, h, qi, ki):
        return (ki <= qi) | (ki < 200 + 64 * b)

    def documents(b, h, qi, ki):
        return ((qi * 7) // 900 == (ki * 7) // 900) & (ki <= qi)

    def empty_rows(b, h, qi, ki):
        return (qi >= 300) & (ki <= qi) & ((h == 0) | (ki > 100))

    def scattered(b, h, qi, ki):
        return ((qi // 128 * 5 + ki // 128 * 3 + h) % 4 == 0) | ((qi - ki) % 13 == 0)

    return dict(causal=causal, sliding=sliding, prefix=prefix, documents=documents, empty_rows=empty_rows,
                scattered=scattered)


@pytest.mark.parametrize("N, S", [(4096, 4096), (1280, 768), (384, 384), (128, 256)])
@pytest.mark.parametrize("mask_name", ["causal", "sliding", "prefix", "documents", "empty_rows", "scattered"])
@pytest.mark.parametrize("batched", [False, True])
def test_union_tables_give_each_warpgroup_its_blocks(mask_name, N, S, batched):
    # The three-warpgroup masked forward (head dim 64): program p covers rows [192p, 192p + 192),
    # whose 64-row warpgroups lie in mask blocks A = 192p // 128 and B = A + 1. Walking the union
    # list as the kernel does (A's warpgroups tiles [0, A's end), B's [B's first, length); the
    # entry's bit for the block says partial), each warpgroup visits exactly the blocks its mask
    # row lists, each once, partial ones with the mask_mod and full ones without; tiles it does not
    # compute are the others' (released in order).
    from flexcore.kernels.forward import BlockTensors
    B, H = 2, 3
    bm = create_block_mask(_union_masks(N)[mask_name], B if batched else None, H, N, S, device="cpu")
    blocks = BlockTensors.expanded(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                   bm.BLOCK_SIZE, B, H)
    counts, entries, exclusive = hopper.union_tables(blocks, N, S, 192)
    programs = -(-N // 192)
    assert counts.shape == (B, H, programs, 3) and counts.dtype == torch.int32
    assert entries.shape == (B, H, programs, -(-S // 128)) and entries.dtype == torch.int32
    assert hopper.union_tables(blocks, N, S, 192) is not None and hopper.union_tables(blocks, N, S, 192)[0] is counts

    def listed(b, h, row):
        n, idx = int(bm.kv_num_blocks[b % bm.kv_num_blocks.shape[0], h, row]), bm.kv_indices
        partial = set(idx[b % idx.shape[0], h, row, :n].tolist())
        fn, fidx = bm.full_kv_num_blocks, bm.full_kv_indices
        full = set(fidx[b % fidx.shape[0], h, row, :int(fn[b % fn.shape[0], h, row])].tolist())
        return partial, full

    walked_rows = 0
    tiles = only_one = 0
    for b in range(B):
        for h in range(H):
            for p in range(programs):
                b_start, a_end, length = counts[b, h, p].tolist()
                assert 0 <= b_start <= a_end <= length <= entries.shape[-1]
                row_list = entries[b, h, p, :length].tolist()
                tiles += length
                if 192 * p // 128 + 1 < -(-N // 128):  # B has rows: its warpgroups wait on A's own tiles
                    only_one += b_start + length - a_end
                row_a = 192 * p // 128
                for w in range(3):
                    first = 192 * p + 64 * w
                    if first >= N:  # past the end: releases every tile
                        continue
                    in_a = first // 128 == row_a
                    lo, hi = (0, a_end) if in_a else (b_start, length)
                    bit = 1 if in_a else 2
                    visited = [(e >> 2, bool(e & bit)) for e in row_list[lo:hi]]
                    blocks_seen = [blk for blk, _ in visited]
                    assert len(set(blocks_seen)) == len(blocks_seen)
                    partial, full = listed(b, h, first // 128)
                    assert {blk for blk, part in visited if part} == partial
                    assert {blk for blk, part in visited if not part} == full
                    walked_rows += 1
    assert walked_rows == B * H * sum(1 for r in range(0, N, 64))
    assert exclusive == pytest.approx(only_one / max(tiles, 1))
    if mask_name == "causal" and N == 4096:  # one tile per program, B's diagonal block (the last B is past the end)
        assert exclusive == pytest.approx(21 / sum(min(192 * p // 128 + 2, 32) for p in range(22)))
        assert exclusive <= DEFAULT_POLICY.gluon.union_max_exclusive


@pytest.mark.parametrize("mask_name, served", [("causal", True), ("prefix", True), ("documents", False)])
def test_union_kernel_only_for_masks_whose_blocks_list_alike(monkeypatch, mask_name, served):
    # The three-warpgroup masked forward serves masks whose two mask blocks per program list mostly
    # the same key blocks (gluon.union_max_exclusive); others keep the template, unless forced.
    from flexcore.kernels.forward import BlockTensors
    N = 4096
    bm = create_block_mask(_union_masks(N)[mask_name], None, None, N, N, device="cpu")
    blocks = BlockTensors.expanded(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                   bm.BLOCK_SIZE, 2, 2)
    default = KernelOptions()
    assert (hopper.masked_tables(blocks, N, N, 64, default) is not None) == served
    assert hopper.masked_tables(blocks, N, N, 128, default)[0][0] is blocks.num_blocks  # two warpgroups: own tables
    opts = policy_options(gluon={"masked": "on"})
    table_args, has_full = hopper.masked_tables(blocks, N, N, 64, opts)
    assert not has_full and table_args[0].shape == (2, 2, 22, 3)


@pytest.mark.parametrize("mask, long", [("causal", True), ("sliding_1024", True), ("documents_256", False),
                                        ("documents_1024", False)])
def test_backward_long_rows(mask, long):
    # The Gluon backward serves masks whose rows, and the rows of their transpose, visit
    # gluon.backward_min_mean_blocks (8) blocks or more on average (a partial block counts 5/4): at 4k a
    # causal mask's rows average 16.75, a 1024-token sliding window's 8.31, causal documents of
    # 1024 tokens 4.75 and of 256 tokens 1.75.
    from flexcore.kernels.backward import q_block_tensors
    from flexcore.kernels.forward import BlockTensors
    N = 4096
    if mask == "causal":
        def mod(b, h, qi, ki):
            return ki <= qi
    elif mask == "sliding_1024":
        def mod(b, h, qi, ki):
            return (ki <= qi) & (qi - ki <= 1024)
    else:
        doc = int(mask.split("_")[1])

        def mod(b, h, qi, ki):
            return (qi // doc == ki // doc) & (ki <= qi)
    bm = create_block_mask(mod, None, None, N, N, device="cpu")
    kv = BlockTensors.expanded(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                               bm.BLOCK_SIZE, 1, 1)
    q = q_block_tensors(bm, 1, 1)
    assert hopper.long_rows(kv, q, N, N, DEFAULT_POLICY.gluon.backward_min_mean_blocks) == long
    assert hopper.long_rows(kv, q, N, N, 1.0)  # every mask here visits a block per row or more


# --- on an sm_90 GPU ---

def _spy(monkeypatch) -> list:
    return shape_spy(monkeypatch, hopper, "forward")


_SHAPES = [
    Shape("h_1k", B=2, Hq=4, Hkv=4, L=1024, S=1024, D=128, Dv=128, block=128),
    Shape("h_gqa", B=1, Hq=16, Hkv=4, L=2048, S=2048, D=128, Dv=128, block=128),
    Shape("h_cross", B=2, Hq=2, Hkv=2, L=384, S=1280, D=128, Dv=128, block=128),
    Shape("h_one_tile", B=1, Hq=2, Hkv=1, L=128, S=128, D=128, Dv=128, block=128),
    Shape("h_two_tiles", B=3, Hq=2, Hkv=2, L=256, S=256, D=128, Dv=128, block=128),
    Shape("h_8k", B=1, Hq=2, Hkv=2, L=8192, S=8192, D=128, Dv=128, block=128),
]
# Head dim 64 runs 192-row programs (DENSE_TILES): the last program of a 4096-row sequence keeps one
# warpgroup of three (21 x 192 + 64 rows), of 1280 rows two, of 128 rows one; 384 rows divide.
_SHAPES_64 = [
    Shape("h64_4k", B=1, Hq=4, Hkv=4, L=4096, S=4096, D=64, Dv=64, block=128),
    Shape("h64_gqa_cross", B=2, Hq=4, Hkv=2, L=1280, S=768, D=64, Dv=64, block=128),
    Shape("h64_one_tile", B=1, Hq=2, Hkv=1, L=128, S=128, D=64, Dv=64, block=128),
    Shape("h64_two_programs", B=3, Hq=2, Hkv=2, L=384, S=256, D=64, Dv=64, block=128),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", _SHAPES + _SHAPES_64, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["none", "noop_mask"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_forward_matches_reference(monkeypatch, shape, dtype, mask, scale):
    opts = policy_options(gluon={"dense": "on"})  # raises if the call is not served
    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(seed_of("hopper", shape.name, str(dtype), mask, scale))
    q, k, v = (t.cuda() for t in shape.qkv(dtype, "cpu", gen))
    bm = None if mask == "none" else create_block_mask(noop_mask, None, None, shape.L, shape.S, device="cuda")
    gqa = shape.Hq != shape.Hkv
    out, lse = flex_attention(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa, return_lse=True, kernel_options=opts)
    assert len(calls) == 1, "the Gluon forward did not run"
    assert_matches_reference(q, k, v, None, bm, out, lse, f"hopper {shape.name} {dtype} {mask} {scale}",
                             scale=scale)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout", ["head_slice", "padded_rows", "bshd"])
@pytest.mark.parametrize("D", [64, 128])
def test_strided_layouts(monkeypatch, layout, D):
    # Views that one (rows, D) descriptor can read take the Gluon kernel; (B, S, H, D) cannot and
    # takes the template. Both match the reference.
    calls = _spy(monkeypatch)
    B, H, N = 2, 4, 1024
    gen = torch.Generator().manual_seed(seed_of("hopper-layout", layout, D))

    def make():
        if layout == "head_slice":
            return torch.randn(B, 2 * H, N, D, generator=gen).to("cuda", torch.bfloat16)[:, 1::2]
        if layout == "padded_rows":
            return torch.randn(B, H, N, D + 64, generator=gen).to("cuda", torch.bfloat16)[..., :D]
        return torch.randn(B, N, H, D, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)

    q, k, v = make(), make(), make()
    out, lse = flex_attention(q, k, v, return_lse=True)
    assert len(calls) == (0 if layout == "bshd" else 1)
    # The output keeps the query's stride order, as torch's: (B, S, H, D) memory for bshd.
    assert out.is_contiguous() == (layout != "bshd")
    assert out.stride() == output_strides(tuple(out.shape), q.stride())
    assert_matches_reference(q, k, v, None, None, out, lse, f"hopper layout {layout} D={D}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["ragged", "d32", "causal", "score_mod", "fp32", "pinned"])
def test_falls_back_to_the_template(monkeypatch, case):
    calls = _spy(monkeypatch)
    L = S = 1000 if case == "ragged" else 1024
    D = 32 if case == "d32" else 128
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(seed_of("hopper-fallback", case))
    q, k, v = (torch.randn(1, 2, n, D, generator=gen).to("cuda", dtype) for n in (L, S, S))
    bm = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, S, device="cuda")
          if case == "causal" else None)
    score_mod = (lambda s, b, h, qi, ki: s + 0.1 * h) if case == "score_mod" else None
    options = {"BLOCK_M": 128, "BLOCK_N": 64} if case == "pinned" else None
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True,
                              kernel_options=options)
    assert not calls
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, f"hopper fallback {case}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", [*_SHAPES[:3], *_SHAPES_64[:2]], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gradients_through_the_gluon_forward(monkeypatch, shape, dtype):
    # The backward reads the Gluon forward's lse and row statistics.
    opts = policy_options(gluon={"dense": "on"})
    calls = _spy(monkeypatch)
    check_backward(shape, "noop", dtype, seed=seed_of("hopper-bwd", shape.name, str(dtype)), device="cuda", kernel_options=opts)
    assert calls


@pytest.mark.gpu
@needs_hopper
def test_repeated_calls_and_cuda_graphs(monkeypatch):
    # Fresh inputs each call give fresh outputs (no plan keeps a stale tensor); a captured graph
    # replays the kernel on new data.
    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(seed_of("hopper-graph"))
    q, k, v = (torch.randn(2, 4, 1024, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    first = flex_attention(q, k, v)
    for _ in range(3):
        q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
        out, lse = flex_attention(q2, k2, v2, return_lse=True)
        assert_matches_reference(q2, k2, v2, None, None, out, lse, "hopper repeated")
    static = [torch.randn_like(t) for t in (q, k, v)]  # other data at capture time
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flex_attention(*static)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = flex_attention(*static)
    torch.cuda.synchronize()
    for t, src in zip(static, (q, k, v)):
        t.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, first)  # the replay read the new contents of the static inputs
    assert len(calls) >= 6


# --- the masked kernel (forward_hopper.py.tmpl) ---

def _spy_masked(monkeypatch) -> list:
    return served_spy(monkeypatch, hopper, "forward_masked")


def _edge_mask(case: str):
    """Masks at L = S = 1024 whose rows keep no key (below row 256), rows a partial block masks
    entirely (rows 128-199), and a mask of partial blocks only."""
    if case == "empty_rows":
        def mask(b, h, qi, ki):
            return (qi >= 256) & (ki <= qi)
    elif case == "rows_masked_inside_a_block":
        def mask(b, h, qi, ki):
            return (qi >= 200) & (ki <= qi)
    else:
        def mask(b, h, qi, ki):
            return (qi - ki) % 7 == 0  # every block partial
    return mask


# At head dim 64 three warpgroups over two mask blocks (union lists): 4096 rows end in a program of
# one live warpgroup, 1280 of two (and causal rows offset by S - L), 128 of one.
_MASKED_SHAPES = [_SHAPES[0], _SHAPES[1], _SHAPES[2], _SHAPES[5], *_SHAPES_64]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", _MASKED_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", ["causal", "sliding_window", "prefix_lm", "document"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_masked_forward_matches_reference(monkeypatch, shape, mod_name, dtype):
    from tests.flexcore.cases import make_mods
    opts = policy_options(gluon={"masked": "on"})  # raises if the call is not served
    calls = _spy_masked(monkeypatch)
    gen = torch.Generator().manual_seed(seed_of("hopper-masked", shape.name, mod_name, str(dtype)))
    q, k, v = (t.cuda() for t in shape.qkv(dtype, "cpu", gen))
    score_mod, mask_mod = make_mods(mod_name, shape, "cuda", gen)
    assert score_mod is None
    bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device="cuda")
    gqa = shape.Hq != shape.Hkv
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa, return_lse=True, kernel_options=opts)
    assert calls == [True], "the masked Gluon forward did not run"
    assert_matches_reference(q, k, v, None, bm, out, lse, f"hopper masked {shape.name} {mod_name} {dtype}")
    # a repeated call runs the plan, on new inputs
    q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
    out2, lse2 = flex_attention(q2, k2, v2, block_mask=bm, enable_gqa=gqa, return_lse=True, kernel_options=opts)
    assert calls == [True, True]
    assert_matches_reference(q2, k2, v2, None, bm, out2, lse2, f"hopper masked again {shape.name} {mod_name}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["empty_rows", "rows_masked_inside_a_block", "no_full_blocks"])
@pytest.mark.parametrize("D", [64, 128])
def test_masked_rows_without_keys(monkeypatch, case, D):
    # Rows with no listed block (n_tiles 0), rows that a partial block masks entirely (m = -inf
    # until a later tile), and masks with partial blocks only: output 0 and lse -inf where nothing
    # is kept, as the template and the reference.
    opts = policy_options(gluon={"masked": "on"})
    calls = _spy_masked(monkeypatch)
    L = S = 1024
    mask = _edge_mask(case)
    gen = torch.Generator().manual_seed(seed_of("hopper-empty", case, D))
    q, k, v = (torch.randn(2, 2, n, D, generator=gen).to("cuda", torch.bfloat16) for n in (L, S, S))
    bm = create_block_mask(mask, None, None, L, S, device="cuda")
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=opts)
    assert calls == [True]  # no_full_blocks' % too: its helper comes in Gluon form
    assert_matches_reference(q, k, v, None, bm, out, lse, f"hopper masked {case} D={D}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("name", ["chunks", "negative_operands"])
def test_masks_with_floor_division_and_remainder_run_in_gluon(monkeypatch, name):
    # Floor division and remainder lower to Triton helpers; the Gluon kernels carry Gluon forms of
    # them (torch's rounding toward negative infinity, negative operands included), forward and
    # backward, and build without a fallback.
    opts = policy_options(gluon={"masked": "on", "backward": "on"})
    forwards, backwards = _spy_masked(monkeypatch), _spy_backward(monkeypatch)
    monkeypatch.setattr(hopper, "_unsupported", {})
    L = S = 1024
    if name == "chunks":
        def mask(b, h, qi, ki):
            return (qi // 256) == (ki // 256)
    else:
        def mask(b, h, qi, ki):
            return ((ki - qi) // 100 >= -5) & ((ki - qi) % 3 != 1) & (ki <= qi)

    gen = torch.Generator().manual_seed(seed_of("hopper-helper", name))
    q, k, v = (torch.randn(1, 2, n, 128, generator=gen).to("cuda", torch.bfloat16) for n in (L, S, S))
    bm = create_block_mask(mask, None, None, L, S, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=opts)
        assert_matches_reference(q, k, v, None, bm, out, lse, f"hopper masked helper {name}")
        _check_grads(q, k, v, bm, f"hopper helper {name}", kernel_options=opts)
    assert forwards and all(forwards) and backwards == [True], (forwards, backwards)
    assert hopper.fallbacks() == {}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mod_name", ["causal", "document"])
@pytest.mark.parametrize("shape", [_SHAPES[1], _SHAPES_64[1]], ids=lambda s: s.name)
def test_gradients_through_the_masked_gluon_forward(monkeypatch, mod_name, shape):
    opts = policy_options(gluon={"masked": "on"})
    calls = _spy_masked(monkeypatch)
    check_backward(shape, mod_name, torch.bfloat16, seed=seed_of("hopper-masked-bwd", mod_name, shape.name),
                   device="cuda", kernel_options=opts)
    assert calls and all(calls)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rows_long", [True, False])
@pytest.mark.parametrize("D", [64, 128])
def test_masked_kernel_only_for_long_rows_by_default(monkeypatch, rows_long, D):
    # The masked Gluon kernel serves masks whose rows visit gluon.masked_min_mean_blocks key
    # blocks or more on average; shorter rows (documents of a few blocks) keep the template. The
    # size rule (below) is lifted here: these calls are smaller than it.
    calls = _spy_masked(monkeypatch)
    L = S = 4096
    doc = 4096 if rows_long else 256
    gen = torch.Generator().manual_seed(seed_of("hopper-rows", rows_long, D))

    def mask(b, h, qi, ki):
        return (qi // doc == ki // doc) & (ki <= qi) if not rows_long else ki <= qi

    q, k, v = (torch.randn(1, 2, n, D, generator=gen).to("cuda", torch.bfloat16) for n in (L, S, S))
    bm = create_block_mask(mask, None, None, L, S, device="cuda")
    opts = policy_options(gluon={"masked_min_flops": 0})
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=opts)
    assert calls == ([True] if rows_long else [])
    assert_matches_reference(q, k, v, None, bm, out, lse, f"hopper rows long={rows_long}")


@pytest.mark.parametrize("shape, large", [
    ((4, 8, 2048, 128), False), ((4, 16, 2048, 128), False),  # 6.9e10 and 1.4e11 dense-equivalent FLOPs
    ((2, 16, 4096, 128), True), ((1, 16, 8192, 128), True), ((1, 16, 16384, 64), True),
])
def test_masked_size_rule(shape, large):
    # Masked calls under gluon.masked_min_flops take the template, forward and backward
    # (docs/decisions.md#gluon-masked-size); the threshold is the policy's.
    B, H, N, D = shape
    q = torch.empty(B, H, N, D, device="meta", dtype=torch.bfloat16)
    assert hopper.large_enough(q, q, q, DEFAULT_POLICY.gluon) == large
    lifted = DEFAULT_POLICY.replace(gluon={"masked_min_flops": 0}).gluon
    assert hopper.large_enough(q, q, q, lifted)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("lifted", [False, True])
def test_small_masked_calls_take_the_template(monkeypatch, lifted):
    # A causal call under gluon.masked_min_flops (1.7e10) runs the template's forward and backward
    # by default, the Gluon kernels with the threshold at 0; gradients against float64 either way.
    import flexcore
    from flexcore.kernels.policy import DispatchPolicy
    fwd_calls, bwd_calls = _spy_masked(monkeypatch), _spy_backward(monkeypatch)
    N, D = 4096, 128
    gen = torch.Generator().manual_seed(seed_of("hopper-size", lifted))
    q, k, v = (torch.randn(1, 2, N, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, N, N, device="cuda")
    policy = DispatchPolicy().replace(gluon={"masked_min_flops": 0}) if lifted else None
    _check_grads(q, k, v, bm, f"size rule lifted={lifted}", kernel_options={"policy": policy})
    assert (fwd_calls, bwd_calls) == (([True], [True]) if lifted else ([], []))
    said = flexcore.explain(q, k, v, block_mask=bm, kernel_options={"policy": policy})
    kernels = ("gluon-masked", "gluon") if lifted else ("triton", "triton")
    assert (said.forward_kernel, said.backward_kernel) == kernels, str(said)
    # forward and backward each name the size rule as the reason, or neither does
    assert str(said).count("masked_min_flops=2e+11") == (0 if lifted else 2), str(said)


@pytest.mark.gpu
@needs_hopper
def test_a_failed_first_launch_runs_the_template_and_explain_says_why(monkeypatch):
    # A Gluon kernel whose first launch fails: one warning, the template's right results for this
    # call and the next, and explain names the kept reason instead of the Gluon kernels.
    import flexcore
    from flexcore.kernels import launch
    monkeypatch.setattr(hopper, "_unsupported", {})
    monkeypatch.setattr(hopper, "_compiled", set())
    launch.clear_plans()
    real_run = launch.run

    def run(kernel, *args, **kwargs):
        if "hopper" in getattr(kernel, "__name__", ""):
            raise RuntimeError("PassManager::run failed (simulated)")
        return real_run(kernel, *args, **kwargs)

    monkeypatch.setattr(launch, "run", run)
    N, D = 4096, 128
    gen = torch.Generator().manual_seed(seed_of("hopper-failed-launch"))
    q, k, v = (torch.randn(1, 2, N, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, N, N, device="cuda")
    opts = {"policy": DEFAULT_POLICY.replace(gluon={"masked_min_flops": 0})}
    with pytest.warns(KernelFallbackWarning, match="simulated") as caught:
        _check_grads(q, k, v, bm, "failed first launch", kernel_options=opts)
    assert [w.category for w in caught].count(KernelFallbackWarning) == 2  # the forward's, the backward's
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True, kernel_options=opts)
    assert_matches_reference(q, k, v, None, bm, out, lse, "after a failed first launch")
    said = flexcore.explain(q, k, v, block_mask=bm, kernel_options=opts)
    assert (said.forward_kernel, said.backward_kernel) == ("triton", "triton"), str(said)
    assert str(said).count("simulated") == 2, str(said)


# --- the backward (backward_hopper.py.tmpl) ---

def _spy_backward(monkeypatch) -> list:
    return served_spy(monkeypatch, hopper, "backward")


def _check_grads(q, k, v, bm, what: str, enable_gqa=False, scale=None, kernel_options=None):
    """Forward + backward against the float64 reference, tolerances relative to torch's own error
    in the same dtype (as check_backward). Returns flexcore's gradients."""
    from flexcore.reference import flex_attention_reference
    from flexcore.testing import assert_close_to_reference
    gen = torch.Generator().manual_seed(seed_of("hopper-grads", what))
    grad_out = torch.randn(q.shape[:3] + (v.shape[3],), generator=gen).to(q.device, q.dtype)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flex_attention(*inputs, block_mask=bm, enable_gqa=enable_gqa, scale=scale, kernel_options=kernel_options)
    ours = torch.autograd.grad(out, inputs, grad_out)
    gold_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gold = flex_attention_reference(*gold_in, block_mask=bm, enable_gqa=enable_gqa, scale=scale, upcast=True)
    golden = torch.autograd.grad(gold, gold_in, grad_out.double())
    base = flex_attention_reference(*inputs, block_mask=bm, enable_gqa=enable_gqa, scale=scale, upcast=False)
    baseline = torch.autograd.grad(base, inputs, grad_out)
    for name, a, g, b, x in zip(("dq", "dk", "dv"), ours, golden, baseline, inputs):
        assert a.shape == x.shape and a.dtype == x.dtype, f"{what} {name}: {a.shape} {a.dtype}"
        assert torch.isfinite(a).all(), f"{what} {name} has NaN/inf"
        assert_close_to_reference(a, g, b, metric="rel_fro", atol=1e-3, name=f"{what}: {name}")
    return ours


_BACKWARD_SHAPES = _SHAPES[:5]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", _BACKWARD_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", ["noop", "causal", "sliding_window", "prefix_lm", "document"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_matches_reference(monkeypatch, shape, mod_name, dtype):
    opts = policy_options(gluon={"backward": "on"})  # raises if the call is not served
    calls = _spy_backward(monkeypatch)
    check_backward(shape, mod_name, dtype, seed=seed_of("hopper-bwd-gluon", shape.name, mod_name, str(dtype)),
                   device="cuda", kernel_options=opts)
    assert calls == [True], "the Gluon backward did not run"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["empty_rows", "rows_masked_inside_a_block", "no_full_blocks", "scale"])
def test_backward_rows_without_keys(monkeypatch, case):
    # Rows that keep no key (lse2 = +inf: p = 0), rows a partial block masks entirely, partial
    # blocks only; and a scale other than the default.
    opts = policy_options(gluon={"backward": "on"})
    calls = _spy_backward(monkeypatch)
    L = S = 1024
    if case == "scale":
        def mask(b, h, qi, ki):
            return ki <= qi
    else:
        mask = _edge_mask(case)
    gen = torch.Generator().manual_seed(seed_of("hopper-bwd-empty", case))
    q, k, v = (torch.randn(2, 2, n, 128, generator=gen).to("cuda", torch.bfloat16) for n in (L, S, S))
    bm = create_block_mask(mask, None, None, L, S, device="cuda")
    _check_grads(q, k, v, bm, f"hopper bwd {case}", scale=0.3 if case == "scale" else None, kernel_options=opts)
    assert calls == [True]  # no_full_blocks' % too: its helper comes in Gluon form


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("layout", ["head_slice", "padded_rows", "shared_batch_gqa"])
def test_backward_layouts(monkeypatch, layout):
    # Views one (rows, D) descriptor reads: every other head, padded rows, and K/V of batch 1
    # shared across the batch (batch stride 0) under GQA, whose dK/dV sum over the batch.
    opts = policy_options(gluon={"backward": "on"})
    calls = _spy_backward(monkeypatch)
    B, H, N, D = 2, 4, 1024, 128
    gen = torch.Generator().manual_seed(seed_of("hopper-bwd-layout", layout))

    def make(batch=B, heads=H):
        if layout == "head_slice":
            return torch.randn(batch, 2 * heads, N, D, generator=gen).to("cuda", torch.bfloat16)[:, 1::2]
        if layout == "padded_rows":
            return torch.randn(batch, heads, N, D + 64, generator=gen).to("cuda", torch.bfloat16)[..., :D]
        return torch.randn(batch, heads, N, D, generator=gen).to("cuda", torch.bfloat16)

    gqa = layout == "shared_batch_gqa"
    q = make()
    k, v = (make(1, 2), make(1, 2)) if gqa else (make(), make())
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, N, N, device="cuda")
    _check_grads(q, k, v, bm, f"hopper bwd layout {layout}", enable_gqa=gqa, kernel_options=opts)
    assert calls == [True]


@pytest.mark.gpu
@needs_hopper
def test_backward_is_deterministic(monkeypatch):
    # No atomics: two backwards of the same inputs give bit-identical gradients (the second through
    # the first one's plan, which replays the launches without calling hopper.backward).
    calls = []
    real = hopper.BackwardLaunches.prepare

    def spy(self, *args, **kwargs):
        calls.append(True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(hopper.BackwardLaunches, "prepare", spy)
    gen = torch.Generator().manual_seed(seed_of("hopper-bwd-det"))
    q, k, v = (torch.randn(2, 8, 2048, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    go = torch.randn_like(q)
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 2048, 2048, device="cuda")
    opts = policy_options(gluon={"masked_min_flops": 0})  # the call is under the size rule
    first = torch.autograd.grad(flex_attention(q, k, v, block_mask=bm, kernel_options=opts), (q, k, v), go)
    second = torch.autograd.grad(flex_attention(q, k, v, block_mask=bm, kernel_options=opts), (q, k, v), go)
    assert calls == [True, True]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask", ["noop", "causal", "sliding_window"])
def test_backward_is_the_templates_bit_for_bit(monkeypatch, mask):
    # Same tiles (dK/dV: 64 queries over 128 keys; dQ: steps of 64 keys), same summation order and
    # the same arithmetic per score: the Gluon kernels and the template give identical gradients
    # (flexcore/README.md says so).
    gen = torch.Generator().manual_seed(seed_of("hopper-bwd-bits", mask))
    q, k, v = (torch.randn(2, 4, 2048, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    go = torch.randn_like(q)
    mods = {"noop": None, "causal": lambda b, h, qi, ki: ki <= qi,
            "sliding_window": lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= 1024)}
    bm = None if mods[mask] is None else create_block_mask(mods[mask], None, None, 2048, 2048, device="cuda")
    calls = _spy_backward(monkeypatch)
    # The template over the mask's own tables (not the finer ones its rule may take for the window).
    # The window's rows are short at 2k: the Gluon backward is forced. Both read one forward: the
    # forward's kernel is a timed choice, and another one changes the output's last bits.
    opts = policy_options(forward={"refine": "off"}, gluon={"backward": "on"})
    fwd = kernel_grads(q, k, v, None, bm, None, None, opts=opts)
    *_, gluon = kernel_grads(q, k, v, None, bm, go, None, opts=opts, forward_result=fwd)
    opts = policy_options(forward={"refine": "off"}, gluon={"backward": "off"})
    *_, template = kernel_grads(q, k, v, None, bm, go, None, opts=opts, forward_result=fwd)
    assert calls == [True]
    for name, a, b in zip(("dq", "dk", "dv"), gluon, template):
        assert torch.equal(a, b), f"{mask} {name}: max difference {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["score_mod", "d64", "ragged"])
def test_backward_falls_back_to_the_template(monkeypatch, case):
    # A score_mod, head dim 64 and lengths that are not multiples of 128 take the template. Every
    # case matches the reference.
    calls = _spy_backward(monkeypatch)
    L = S = 1000 if case == "ragged" else 1024
    D = 64 if case == "d64" else 128
    gen = torch.Generator().manual_seed(seed_of("hopper-bwd-fallback", case))
    q, k, v = (torch.randn(1, 2, n, D, generator=gen).to("cuda", torch.bfloat16) for n in (L, S, S))
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, L, S, device="cuda")
    if case == "score_mod":
        inputs = [t.requires_grad_() for t in (q, k, v)]
        out = flex_attention(*inputs, score_mod=lambda s, b, h, qi, ki: s * 0.5, block_mask=bm)
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in inputs)
    else:
        _check_grads(q, k, v, bm, f"hopper bwd fallback {case}")
    assert calls == [], calls


# --- lse gradients, +inf scores and the output's stride order on the Gluon kernels ---

@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("shape", _BACKWARD_SHAPES[:2], ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", ["noop", "causal", "document"])
def test_backward_lse_gradient(monkeypatch, shape, mod_name):
    # grad_lse through the Gluon backward (the preprocessing kernel's delta carries it) against the
    # float64 autograd of (out * g).sum() + (lse * h).sum(), tolerances relative to torch's bf16.

    opts = policy_options(gluon={"backward": "on"})  # raises if the call is not served
    calls = _spy_backward(monkeypatch)
    check_lse_grads(shape, mod_name, torch.bfloat16, seed_of("hopper-lse-grad", shape.name, mod_name), device="cuda", opts=opts)
    assert calls == [True], "the Gluon backward did not run"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("mask", ["noop", "causal"])
def test_backward_lse_gradient_is_the_templates_bit_for_bit(monkeypatch, mask):
    # Both read the same delta - grad_lse from the preprocessing kernel: identical gradients.

    gen = torch.Generator().manual_seed(seed_of("hopper-lse-bits", mask))
    q, k, v = (torch.randn(2, 4, 1024, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    grad_out = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
    grad_lse = torch.randn(q.shape[:3], generator=gen).to("cuda")
    bm = None if mask == "noop" else create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 1024, 1024,
                                                       device="cuda")
    calls = _spy_backward(monkeypatch)
    opts = policy_options(forward={"refine": "off"}, gluon={"backward": "on"})
    fwd = kernel_grads(q, k, v, None, bm, None, None, opts=opts)
    *_, gluon = kernel_grads(q, k, v, None, bm, grad_out, grad_lse, opts=opts, forward_result=fwd)
    opts = policy_options(forward={"refine": "off"}, gluon={"backward": "off"})
    *_, template = kernel_grads(q, k, v, None, bm, grad_out, grad_lse, opts=opts, forward_result=fwd)
    assert calls == [True]
    for name, a, b in zip(("dq", "dk", "dv"), gluon, template):
        assert torch.equal(a, b), f"{mask} {name}: max difference {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", ["noop", "causal"])
def test_lse_is_inf_where_a_score_is_inf(monkeypatch, D, mask):
    # +inf in k: lse +inf on the rows whose score is +inf (it was NaN), as the float64 reference's.
    from flexcore.reference import flex_attention_reference

    if mask == "noop":
        opts = policy_options(gluon={"dense": "on"})
        calls = _spy(monkeypatch)
    else:
        opts = policy_options(gluon={"masked": "on"})
        calls = _spy_masked(monkeypatch)
    gen = torch.Generator().manual_seed(seed_of("hopper-inf", D, mask))
    q, k, v = (torch.randn(1, 2, 1024, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    k[0, 0, 5, 0] = float("inf")
    bm = None if mask == "noop" else create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 1024, 1024,
                                                       device="cuda")
    out, aux = flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True), kernel_options=opts)
    lse = aux.lse
    assert calls and all(calls), "the Gluon forward did not run"
    gold, gold_lse = flex_attention_reference(q, k, v, block_mask=bm, return_lse=True)
    plus = gold_lse == float("inf")
    assert plus.any()
    assert torch.equal(lse == float("inf"), plus)
    assert torch.equal(out.isnan(), gold.isnan())
    fin = torch.isfinite(gold_lse)
    assert (lse[fin].double() - gold_lse[fin]).abs().max() <= 1e-2


@pytest.mark.gpu
@needs_hopper
def test_output_keeps_the_query_order(monkeypatch):
    # A query whose heads are outermost in memory: the Gluon kernels cannot write that order through
    # their descriptor, so the template serves it, and the output has the query's order, as torch's.
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(seed_of("hopper-order"))
    q = torch.randn(4, 2, 1024, 128, generator=gen).to("cuda", torch.bfloat16).transpose(0, 1)
    k, v = (torch.randn(2, 4, 1024, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    assert not calls
    assert out.stride() == torch_flex(q, k, v).stride() == q.stride()
    assert_matches_reference(q, k, v, None, None, out, lse, "hopper query order")
    out2 = flex_attention(q.contiguous(), k, v)  # the usual order: the Gluon kernel, contiguous
    assert calls and out2.is_contiguous()
