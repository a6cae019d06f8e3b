"""Per-program fixed cost of the forward (bench/NOTES.md entry 33): forward time against sequence
length at a constant B·S = 16384 (H=16, bf16), for noop, causal and an 8-document causal mask,
with K/V descriptors (the default on Hopper) and with pointer loads, beside torch's compiled
flex_attention. Short rows (S=512: 4 key blocks per row) show the cost that does not scale with
the row. Usage: PYTHONPATH=. python3 bench/probes/fixed_cost.py 128"""
import sys

import torch
import torch._dynamo
import triton
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import flexcore.kernels.forward as F
from flexcore import create_block_mask, flex_attention

torch._dynamo.config.cache_size_limit = 1000
torch._dynamo.config.accumulated_cache_size_limit = 1000
compiled = torch.compile(torch_flex, dynamic=False)
H, D = 16, int(sys.argv[1]) if len(sys.argv) > 1 else 128


def bench(fn):
    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def causal(b, h, q, kv):
    return q >= kv


for S in (512, 1024, 2048, 4096):
    B = 16384 // S
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc = (torch.arange(S, device="cuda") * 8) // S

    def document(b, h, qi, kv):
        return (doc[qi] == doc[kv]) & (qi >= kv)

    for name, mm in (("noop", None), ("causal", causal), ("doc8", document)):
        bm = create_block_mask(mm, None, None, S, S) if mm else None
        tbm = torch_block_mask(mm, None, None, S, S, device="cuda") if mm else None
        row = [f"D={D} S={S:5d} B={B:2d} {name:6s}"]
        for tag, tma in (("descriptors", None), ("pointers", False)):
            F.TMA = tma; F._autotuners.clear()
            row.append(f"{tag} {bench(lambda: flex_attention(q, k, v, block_mask=bm)):7.1f}us")
        F.TMA = None
        row.append(f"torch {bench(lambda: compiled(q, k, v, block_mask=tbm)):7.1f}us")
        print(" ".join(row), flush=True)
