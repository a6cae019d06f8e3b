"""Train a tiny model a few steps with context-parallel flex attention and a document-causal mask.

Run on one machine (gloo on CPUs, NCCL on GPUs, picked from the device):

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.cp_train --steps 3

Every rank holds the whole batch of tokens and keeps its zigzag shard of the sequence; the mask and
the rotary positions use global positions. Each rank's loss is the sum over its tokens divided by
the global token count, so the ranks' losses add up to the mean over the sequence; the parameters'
gradients are summed over the ranks after backward (as data parallelism would).
``--check`` also compares the first step's loss with one process computing the whole sequence.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from flexcore import distributed as cp


def document_ids(seq_len: int, n_docs: int, device, seed: int = 0) -> torch.Tensor:
    """Document of each position: n_docs documents of random lengths covering seq_len."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(seq_len - 1, generator=g)[: n_docs - 1].sort().values + 1
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([seq_len])]))
    return torch.repeat_interleave(torch.arange(n_docs), lengths).to(device)


class TinyLM(nn.Module):
    """Embedding, one attention block with rotary positions, an MLP, a tied head."""

    def __init__(self, vocab: int, d_model: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.embed = nn.Embedding(vocab, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device) / half)
        angle = positions.to(torch.float32)[:, None] * freq[None, :]
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, tokens, positions, attend):
        """tokens (B, S_local), positions (S_local,) global; attend(q, k, v) -> (B, H, S_local, Dh)."""
        x = self.embed(tokens)
        B, L, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q, positions), self.rotary(k, positions)
        y = attend(q.contiguous(), k.contiguous(), v.contiguous())
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, -1))
        x = x + self.mlp(self.norm2(x))
        return x @ self.embed.weight.T / math.sqrt(x.shape[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cp_train", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, help="global sequence length (default 256 on CPU, 16384 on GPU)")
    parser.add_argument("--docs", type=int, default=4, help="documents in the sequence")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--strategy", default="auto", choices=cp.STRATEGIES)
    parser.add_argument("--check", action="store_true", help="compare step 0's loss with one process")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    seq = args.seq or (16384 if cuda else 256)
    block = 128 if cuda else 32
    dtype = torch.bfloat16 if cuda else torch.float32

    torch.manual_seed(0)  # the same parameters and batch on every rank
    model = TinyLM(args.vocab, args.d_model, args.heads).to(device)
    tokens = torch.randint(0, args.vocab, (1, seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    doc = document_ids(seq, args.docs, device)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = cp.create_block_mask_for_rank(document_causal, None, None, seq, BLOCK_SIZE=block, device=device)
    local_inputs = cp.shard_sequence(inputs, dim=1)
    local_targets = cp.shard_sequence(targets, dim=1)
    positions = cp.shard_positions(seq, world, rank, device=device)

    def attend(q, k, v):
        return cp.flex_attention(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=mask,
                                 strategy=args.strategy).to(q.dtype)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        logits = model(local_inputs, positions, attend)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), local_targets.flatten(),
                                           reduction="sum") / seq
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():  # the gradient of the global loss: sum over the ranks
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        if step == 0 and args.check:
            _check(model, inputs, targets, doc, document_causal, block, dtype, float(total), rank)
        opt.step()
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    # Every rank done before any tears its transport down.
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(math.isfinite(x) for x in losses) else 1


@torch.no_grad()
def _check(model, inputs, targets, doc, mask_mod, block, dtype, cp_loss, rank):
    """Step 0's loss from one process over the whole sequence, with flexcore's flex_attention."""
    from flexcore import create_block_mask, flex_attention

    seq = inputs.shape[1]
    bm = create_block_mask(mask_mod, None, None, seq, seq, device=inputs.device, BLOCK_SIZE=block)
    positions = torch.arange(seq, device=inputs.device)

    def attend(q, k, v):
        return flex_attention(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=bm).to(q.dtype)

    logits = model(inputs, positions, attend)
    single = float(nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()))
    if rank == 0:
        print(f"check: context-parallel loss {cp_loss:.6f}, one process {single:.6f}, "
              f"difference {abs(cp_loss - single):.2e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
