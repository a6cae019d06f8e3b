"""Context-parallel flex attention (flexcore.distributed): 2 and 4 gloo processes on the CPU against
single-process flexcore and the float64 reference; bad input raises on every rank; 2-GPU NCCL runs."""
from __future__ import annotations

import dataclasses
import functools
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from flexcore import distributed as cp

S = 128        # global length: 4 chunks of 32 at 2 ranks, 8 chunks of 16 at 4
B, H, D = 1, 2, 16
WINDOW = 24
PREFIX = 40
MASKS = ("causal", "document_causal", "sliding_window", "prefix_lm")


def _doc_ids(device):
    # Uneven documents whose boundaries fall inside chunks, so shards hold pieces of several.
    lengths = [20, 50, 10, 48]
    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(lengths, device=device))


def make_mods(name: str, device, doc_ids=None):
    """(mask_mod, score_mod, rel) of a case: the score_mod reads a learnable relative-position
    table by global position, so a wrong position mapping or a missing gradient sum shows."""
    doc = _doc_ids(device) if doc_ids is None else doc_ids
    rel = (0.1 * torch.randn(2 * S - 1, generator=torch.Generator().manual_seed(7))).to(device)
    rel.requires_grad_(True)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < PREFIX) | (q_idx >= kv_idx)

    def scattered(b, h, q_idx, kv_idx):
        # At 4 ranks (zigzag chunks of S/8): rank 0 reads ranks 1 and 3, rank 1 reads rank 2, so
        # a rank's backward exchanges come in an order other than its ring steps'.
        cq, ck = q_idx // (S // 8), kv_idx // (S // 8)
        return (q_idx == kv_idx) | ((cq == 0) & ((ck == 1) | (ck == 3))) | ((cq == 1) & (ck == 2))

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + S - 1]

    mods = {"causal": causal, "document_causal": document_causal, "sliding_window": sliding_window,
            "prefix_lm": prefix_lm, "scattered": scattered}
    return mods[name], rel_bias, rel


def full_inputs(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g).to(device, dtype) for _ in range(4))
    return q, k, v, dout


# ---- workers (run in spawned processes) ---------------------------------------------------------


def _init(rank, world, port, backend="gloo"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))


def _run_cases(rank, world, device, cases, block):
    """Outputs and gradients of each (mask, strategy) case, this rank's shards."""
    results = {}
    q, k, v, dout = full_inputs(device, torch.float32 if device == "cpu" else torch.bfloat16)
    for mask_name, strategy in cases:
        mask_mod, score_mod, rel = make_mods(mask_name, device)
        bm = cp.create_block_mask_for_rank(mask_mod, None, None, S, BLOCK_SIZE=block, device=device)
        ql, kl, vl = (cp.shard_sequence(t).requires_grad_(True) for t in (q, k, v))
        out = cp.flex_attention(ql, kl, vl, score_mod=score_mod, block_mask=bm, strategy=strategy)
        (out.float() * cp.shard_sequence(dout).float()).sum().backward()
        results[(mask_name, strategy)] = {
            "out": out.detach().cpu(), "dq": ql.grad.cpu(), "dk": kl.grad.cpu(), "dv": vl.grad.cpu(),
            "drel": rel.grad.cpu(), "need": bm.need}
    return results


def _worker_cases(rank, world, port, out_dir, cases, block, backend="gloo"):
    import torch.distributed as dist

    try:
        _init(rank, world, port, backend)
        device = "cuda" if backend == "nccl" else "cpu"
        torch.save(_run_cases(rank, world, device, cases, block), Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _expect_error(fn):
    try:
        fn()
    except cp.ContextParallelError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded: the test says which error it wanted
        return f"WRONG {type(exc).__name__}: {exc}"
    return "NO ERROR"


def _worker_bad_input(rank, world, port, out_dir):
    """Each bad input in turn; every rank records the message it got (all must raise)."""
    _init(rank, world, port)
    found = {}
    mask_mod, _, _ = make_mods("causal", "cpu")
    q, k, v, _ = full_inputs("cpu")
    ql, kl, vl = (cp.shard_sequence(t) for t in (q, k, v))
    found["seq_len"] = _expect_error(lambda: cp.create_block_mask_for_rank(
        mask_mod, None, None, S + 2, BLOCK_SIZE=32, device="cpu"))
    bad = ql[:, :, :31]  # 31 x 2 ranks is not divisible by 2 x 2 zigzag chunks
    found["shard_len"] = _expect_error(lambda: cp.flex_attention(bad, kl[:, :, :31], vl[:, :, :31],
                                                                 mask_mod=mask_mod, BLOCK_SIZE=32))
    bm = cp.create_block_mask_for_rank(mask_mod, None, None, S, BLOCK_SIZE=32, device="cpu")
    wrong_world = dataclasses.replace(bm, world_size=4)
    found["world"] = _expect_error(lambda: cp.flex_attention(ql, kl, vl, block_mask=wrong_world))
    # Rank 1 passes a shard of another length: only the exchange of signatures can see it.
    n = 64 if rank == 0 else 32
    found["ranks_disagree"] = _expect_error(lambda: cp.flex_attention(
        ql[:, :, :n], kl[:, :, :n], vl[:, :, :n], mask_mod=mask_mod, BLOCK_SIZE=32))
    # A document-id tensor that holds only the local shard on rank 1 (the global one elsewhere).
    doc = _doc_ids("cpu")
    local_doc = doc if rank == 0 else cp.shard_sequence(doc, dim=0)
    doc_mask, _, _ = make_mods("document_causal", "cpu", doc_ids=local_doc)
    found["missing_global"] = _expect_error(lambda: cp.create_block_mask_for_rank(
        doc_mask, None, None, S, BLOCK_SIZE=32, device="cpu"))
    rel_bad = torch.zeros(2 * S - 1 if rank == 0 else S - 1)

    def short_table(score, b, h, q_idx, kv_idx):
        return score + rel_bad[q_idx - kv_idx + S - 1]

    found["missing_global_score"] = _expect_error(lambda: cp.flex_attention(
        ql, kl, vl, score_mod=short_table, block_mask=bm))
    # The same through a module attribute (a module as the score_mod).
    found["missing_global_module"] = _expect_error(lambda: cp.flex_attention(
        ql, kl, vl, score_mod=_TableBias(rel_bad), block_mask=bm))
    # What the local call would refuse on one rank only must reach every rank before any transfer.
    found["kv_dtype"] = _expect_error(lambda: cp.flex_attention(
        ql, kl.double() if rank == 1 else kl, vl, block_mask=bm))
    found["enable_gqa"] = _expect_error(lambda: cp.flex_attention(
        ql, kl[:, :1], vl[:, :1], block_mask=bm, enable_gqa=rank == 0))
    learning = torch.zeros(2 * S - 1, requires_grad=rank == 0)  # would wait in the backward's sum
    found["learning_on_one_rank"] = _expect_error(lambda: cp.flex_attention(
        ql, kl, vl, score_mod=_TableBias(learning), block_mask=bm))
    found["mask_mods_differ"] = _expect_error(lambda: cp.flex_attention(
        ql, kl, vl, mask_mod=mask_mod if rank == 0 else make_mods("prefix_lm", "cpu")[0], BLOCK_SIZE=32))
    # A rank that never arrives: the other's check times out instead of hanging.
    cp.flex_attention(ql, kl, vl, block_mask=bm, timeout_s=3)
    if rank == 0:
        found["timeout"] = _expect_error(lambda: cp.flex_attention(ql, kl, vl, block_mask=bm,
                                                                   timeout_s=3))
    else:
        import time

        time.sleep(6)
    torch.save(found, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)  # no teardown: rank 0's timed-out group cannot finish its barrier


class _TableBias(torch.nn.Module):
    """A relative-position bias held by a module, as a model holds one: the score_mod is the
    module itself, or its bound method."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.table[q_idx - kv_idx + S - 1]

    def bias(self, score, b, h, q_idx, kv_idx):
        return score + self.table[q_idx - kv_idx + S - 1]


def _bias_with_default(score, b, h, q_idx, kv_idx, table=None):
    return score + table[q_idx - kv_idx + S - 1]


def _score_mod_kinds(table):
    """Score_mods that read ``table`` other than through a closure or a global."""
    module = _TableBias(torch.nn.Parameter(table.detach().clone()))
    return {
        "module": (module, module.table),
        "bound method": (module.bias, module.table),
        "partial": (functools.partial(_bias_with_default, table=table), table),
        "default argument": (lambda s, b, h, q, k, t=table: s + t[q - k + S - 1], table),
    }


def _learning_table(dtype=torch.float32):
    table = 0.1 * torch.randn(2 * S - 1, generator=torch.Generator().manual_seed(7))
    return table.to(dtype).requires_grad_(True)


def _worker_mod_kinds(rank, world, port, out_dir):
    """The gradient of a learning table reached through each kind of score_mod (summed over the
    group on every rank), and return_aux's lse and max_scores."""
    import torch.distributed as dist

    from flexcore import AuxRequest

    try:
        _init(rank, world, port)
        mask_mod, _, _ = make_mods("causal", "cpu")
        bm = cp.create_block_mask_for_rank(mask_mod, None, None, S, BLOCK_SIZE=32, device="cpu")
        q, k, v, dout = full_inputs("cpu")
        results = {}
        for kind, (score_mod, table) in _score_mod_kinds(_learning_table()).items():
            for strategy in ("ring", "allgather"):
                table.grad = None
                ql, kl, vl = (cp.shard_sequence(t).requires_grad_(True) for t in (q, k, v))
                out, aux = cp.flex_attention(ql, kl, vl, score_mod=score_mod, block_mask=bm,
                                             strategy=strategy,
                                             return_aux=AuxRequest(lse=True, max_scores=True))
                ((out * cp.shard_sequence(dout)).sum() + aux.lse.sum()).backward()
                results[(kind, strategy)] = {"out": out.detach(), "dq": ql.grad, "dtable": table.grad.clone(),
                                             "lse": aux.lse.detach(), "max": aux.max_scores}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _worker_reinit(rank, world, port, out_dir, second_port):
    """Two process groups one after the other in one process (as a job that restarts its group):
    the second group's calls check their inputs on a group of their own world, not on the one that
    the first world's destroy_process_group destroyed."""
    import torch.distributed as dist

    from flexcore.distributed import _side_group

    try:
        mask_mod, _, _ = make_mods("causal", "cpu")
        q, k, v, _ = full_inputs("cpu")
        outs = []
        for p in (port, second_port):
            _init(rank, world, p)
            bm = cp.create_block_mask_for_rank(mask_mod, None, None, S, BLOCK_SIZE=32, device="cpu")
            outs.append(cp.flex_attention(*(cp.shard_sequence(t) for t in (q, k, v)), block_mask=bm,
                                          strategy="ring", timeout_s=30))
            # The group the call checked on is one of this world's (KeyError for a destroyed one).
            outs.append(dist.get_process_group_ranks(_side_group(dist.group.WORLD, 30)))
            dist.destroy_process_group()
        torch.save(outs, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


# ---- the parent ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world, tmp_path, *args, timeout=240):
    """Runs ``target(rank, world, port, tmp_path, *args)`` in ``world`` processes; fails the test,
    with each rank's traceback, if one fails or any outlives ``timeout`` (a hang)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(tmp_path), *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        procs[r].kill()
        procs[r].join()
    errors = [(tmp_path / f"rank{r}.err") for r in range(world)]
    text = "\n".join(e.read_text() for e in errors if e.exists())
    assert not alive, f"ranks {alive} still running after {timeout} s (a hang)\n{text}"
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}\n{text}"
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _unshard(pieces: list[torch.Tensor], world: int) -> torch.Tensor:
    full = torch.empty(pieces[0].shape[0], pieces[0].shape[1], S, pieces[0].shape[3], dtype=pieces[0].dtype)
    for r, piece in enumerate(pieces):
        full[:, :, cp.shard_positions(S, world, r)] = piece
    return full


@functools.lru_cache(maxsize=None)
def _single_process(mask_name: str, dtype=torch.float32, block=32):
    """(flexcore, float64 reference, reference in the dtype) of out, dq, dk, dv, drel (kept: the
    two- and four-rank tests compare with the same single-process runs; callers only read them)."""
    from flexcore import create_block_mask, flex_attention
    from flexcore.reference import flex_attention_reference

    q, k, v, dout = full_inputs("cpu", dtype)
    runs = []
    for fn, kw in ((flex_attention, {}), (flex_attention_reference, {"upcast": True}),
                   (flex_attention_reference, {"upcast": False})):
        mask_mod, score_mod, rel = make_mods(mask_name, "cpu")
        bm = create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=block)
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fn(qq, kk, vv, score_mod=score_mod, block_mask=bm, **kw)
        (out * dout.to(out.dtype)).sum().backward()
        runs.append({"out": out.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad, "drel": rel.grad})
    return runs


def _check_against_single(results, world, cases):
    from flexcore.testing import assert_close_to_reference

    singles = {}
    for mask_name, strategy in cases:
        if mask_name not in singles:
            singles[mask_name] = _single_process(mask_name)
        ours_single, golden, torch_same = singles[mask_name]
        for name in ("out", "dq", "dk", "dv"):
            got = _unshard([results[r][(mask_name, strategy)][name] for r in range(world)], world)
            label = f"{mask_name}/{strategy}/{world} ranks: {name}"
            assert_close_to_reference(got, golden[name], torch_same[name], name=label)
            torch.testing.assert_close(got, ours_single[name], atol=2e-5, rtol=1e-4, msg=label)
        for r in range(world):  # summed over the group: the same full gradient on every rank
            label = f"{mask_name}/{strategy}/{world} ranks: drel on rank {r}"
            drel = results[r][(mask_name, strategy)]["drel"]
            assert_close_to_reference(drel, golden["drel"], torch_same["drel"], name=label)
            torch.testing.assert_close(drel, ours_single["drel"], atol=2e-5, rtol=1e-4, msg=label)


# Every mask through the ring; the all-gather with causal and prefix-LM here, with documents at
# four ranks below, and with every mask on two GPUs (test_two_gpus_nccl_match_reference).
CASES = [(m, "ring") for m in MASKS] + [("causal", "allgather"), ("prefix_lm", "allgather")]


def test_two_ranks_match_single_process(tmp_path):
    results = _spawn(_worker_cases, 2, tmp_path, CASES, 32)
    _check_against_single(results, 2, CASES)
    # A sliding window leaves pairs of shards empty: the plan must know it on every rank.
    assert results[0][("causal", "ring")]["need"] == ((True, True), (True, True))


def test_four_ranks_match_single_process(tmp_path):
    # Chunks of 16 at 4 ranks: blocks of 16 keep the masks' tables exact per chunk. The ring
    # over several steps with shard pairs skipped (the window) and exchanges out of ring order
    # (scattered); the all-gather once, with uneven documents (every mask runs at 2 ranks above).
    cases = [("sliding_window", "ring"), ("scattered", "ring"), ("document_causal", "allgather")]
    results = _spawn(_worker_cases, 4, tmp_path, cases, 16)
    _check_against_single(results, 4, cases)
    scattered = results[0][("scattered", "ring")]["need"]
    assert scattered[0][1] and scattered[0][3] and scattered[1][2] and not scattered[0][2], scattered
    need = results[0][("sliding_window", "ring")]["need"]
    assert not all(all(row) for row in need), f"a window of {WINDOW} should skip shard pairs: {need}"
    assert need == results[3][("sliding_window", "ring")]["need"]


def test_bad_input_raises_on_every_rank(tmp_path):
    found = _spawn(_worker_bad_input, 2, tmp_path, timeout=180)
    expect = {
        "seq_len": "seq_len=130 is not divisible by 2 x world size = 4",
        "shard_len": "not divisible by 2 x world size = 4",
        "world": "built for rank",
        "ranks_disagree": "query differs across ranks",
        "missing_global": "rank 1",
        "missing_global_score": "captured tensors differs across ranks",
        "missing_global_module": "captured tensors differs across ranks",
        "kv_dtype": "rank 1: query, key and value must share a dtype",
        "enable_gqa": "rank 1: query has 2 heads and key/value 1; pass enable_gqa=True",
        "learning_on_one_rank": "captured tensors differs across ranks",
        "mask_mods_differ": "mask_mod differs across ranks",
    }
    for rank, got in enumerate(found):
        for key, text in expect.items():
            assert text in got[key], f"rank {rank}, {key}: {got[key]!r}"
    assert "did not all arrive within 3 s" in found[0]["timeout"], found[0]["timeout"]


def test_learning_tensors_of_modules_partials_and_defaults_get_the_summed_gradient(tmp_path):
    from flexcore import create_block_mask
    from flexcore.reference import flex_attention_reference

    results = _spawn(_worker_mod_kinds, 2, tmp_path, timeout=300)
    q, k, v, dout = (t.double() for t in full_inputs("cpu"))
    mask_mod, _, _ = make_mods("causal", "cpu")
    bm = create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=32)
    for kind in _score_mod_kinds(_learning_table()):
        score_mod, table = _score_mod_kinds(_learning_table(torch.float64))[kind]
        qq = q.clone().requires_grad_(True)
        out, lse = flex_attention_reference(qq, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
        ((out * dout).sum() + lse.sum()).backward()
        with torch.no_grad():  # max_scores: the modded, masked scores' row maximum, written out
            i = torch.arange(S).view(-1, 1)
            scores = score_mod(q @ k.transpose(-1, -2) / D ** 0.5, 0, 0, i, i.T)
            scores = scores.masked_fill(i < i.T, -torch.inf)
        golden = {"out": out.detach(), "dq": qq.grad, "lse": lse.detach(), "max": scores.amax(-1)}
        for strategy in ("ring", "allgather"):
            label = f"{kind}/{strategy}"
            for name in ("out", "dq", "lse", "max"):
                pieces = [results[r][(kind, strategy)][name] for r in range(2)]
                if name in ("lse", "max"):  # (B, H, S_local): unshard as (B, H, S_local, 1)
                    got = _unshard([p.unsqueeze(-1) for p in pieces], 2).squeeze(-1)
                else:
                    got = _unshard(pieces, 2)
                torch.testing.assert_close(got.double(), golden[name], atol=2e-5, rtol=1e-4,
                                           msg=f"{label}: {name}")
            for r in range(2):  # the full gradient on every rank, as in one process
                torch.testing.assert_close(results[r][(kind, strategy)]["dtable"].double(), table.grad,
                                           atol=2e-5, rtol=1e-4, msg=f"{label}: dtable on rank {r}")


def test_a_second_process_group_gets_its_own_checking_group(tmp_path):
    results = _spawn(_worker_reinit, 2, tmp_path, _free_port(), timeout=180)
    for rank, (first, first_side, second, second_side) in enumerate(results):
        torch.testing.assert_close(second, first, rtol=0, atol=0, msg=f"rank {rank}")
        assert first_side == second_side == [0, 1], (rank, first_side, second_side)


def test_uninitialised_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(cp.ContextParallelError, match="not initialised.*init_process_group"):
        cp.flex_attention(q, q, q)
    with pytest.raises(cp.ContextParallelError, match="not initialised"):
        cp.create_block_mask_for_rank(None, None, None, 64)


def test_shard_helpers_round_trip_without_a_group():
    x = torch.arange(16).view(1, 1, 16, 1)
    shards = [cp.shard_sequence(x, rank=r, world_size=2) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shards[1].flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for r in range(2):
        assert torch.equal(cp.shard_positions(16, 2, r), shards[r].flatten())
    contiguous = cp.shard_sequence(x, rank=1, world_size=2, sharding="contiguous")
    assert contiguous.flatten().tolist() == list(range(8, 16))
    with pytest.raises(cp.ContextParallelError, match="x.shape\\[2\\]=16 is not divisible"):
        cp.shard_sequence(x, rank=0, world_size=3)
    assert torch.equal(cp.shard_sequence(x, rank=1, world_size=2, dim=-2), shards[1])
    # NumPy and 0-d tensor integers are integers.
    import numpy as np
    assert torch.equal(cp.shard_sequence(x, rank=np.int64(1), world_size=torch.tensor(2)), shards[1])
    assert torch.equal(cp.shard_positions(16, np.int32(2), np.int64(1)), shards[1].flatten())
    for call, match in [
        (lambda: cp.shard_sequence(x, rank=2, world_size=2), r"rank=2; expected an int in \[0, 2\)"),
        (lambda: cp.shard_sequence(x, rank=-1, world_size=2), r"rank=-1; expected an int in \[0, 2\)"),
        (lambda: cp.shard_sequence(x, rank=0, world_size=0), "world_size=0; expected a positive int"),
        (lambda: cp.shard_sequence(x, dim=7, rank=0, world_size=2), r"dim=7 is not an axis of x of shape"),
        (lambda: cp.shard_positions(16, 0, 0), "world_size=0; expected a positive int"),
        (lambda: cp.shard_positions(16, 2, "a"), "rank='a'; expected an int"),
        (lambda: cp.shard_sequence(x, rank=True, world_size=2), "rank=True; expected an int"),
    ]:
        with pytest.raises(cp.ContextParallelError, match=match):
            call()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_gpus_nccl_match_reference(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from flexcore.testing import assert_close_to_reference

    cases = [(m, s) for m in MASKS for s in ("allgather", "ring")]
    results = _spawn(_worker_cases, 2, tmp_path, cases, 32, "nccl")
    for mask_name, strategy in cases:
        q, k, v, dout = full_inputs("cuda", torch.bfloat16)
        _, golden, torch_same = _single_process_on(mask_name, q, k, v, dout)
        for name in ("out", "dq", "dk", "dv"):
            got = _unshard([results[r][(mask_name, strategy)][name] for r in range(2)], 2)
            # The merge of two bf16 partial outputs adds one rounding: factor 3.
            assert_close_to_reference(got.float(), golden[name].cpu(), torch_same[name].cpu().float(),
                                      factor=3.0, name=f"{mask_name}/{strategy}: {name}")


def _single_process_on(mask_name, q, k, v, dout):
    from flexcore import create_block_mask
    from flexcore.reference import flex_attention_reference

    runs = [None]
    for upcast in (True, False):
        mask_mod, score_mod, rel = make_mods(mask_name, q.device)
        bm = create_block_mask(mask_mod, None, None, S, S, device=q.device, BLOCK_SIZE=32)
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = flex_attention_reference(qq, kk, vv, score_mod=score_mod, block_mask=bm, upcast=upcast)
        (out * dout.to(out.dtype)).sum().backward()
        runs.append({"out": out.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad, "drel": rel.grad})
    return runs
