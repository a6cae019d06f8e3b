"""Mods and shapes shared by the forward, backward and GPU tests.

Each mod factory takes the problem shape and returns (score_mod, mask_mod); captured tensors are
built on the given device from a local generator, so every test draws fresh inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexcore import and_masks, or_masks


@dataclass(frozen=True)
class Shape:
    name: str
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int
    block: int | tuple[int, int]

    def qkv(self, dtype, device, generator=None, requires_grad=False):
        def rand(*shape):
            t = torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
            return t.requires_grad_(requires_grad)

        return (rand(self.B, self.Hq, self.L, self.D), rand(self.B, self.Hkv, self.S, self.D),
                rand(self.B, self.Hkv, self.S, self.Dv))


# Why these shapes: 97 and 100 are not multiples of any tile (ragged last block); 191 spans several
# blocks with a ragged end; 64x300 is cross attention with KV longer than Q; 8:2 is GQA; D=80 is a
# non-power-of-two head dim and Dv=48 differs from D.
CPU_SHAPES = [
    Shape("square97", B=2, Hq=2, Hkv=2, L=97, S=97, D=64, Dv=64, block=32),
    Shape("square191", B=1, Hq=2, Hkv=2, L=191, S=191, D=32, Dv=32, block=64),
    Shape("cross64x300", B=1, Hq=2, Hkv=2, L=64, S=300, D=32, Dv=32, block=64),
    Shape("gqa8to2", B=1, Hq=8, Hkv=2, L=128, S=128, D=32, Dv=32, block=32),
    Shape("d80_dv48", B=1, Hq=2, Hkv=2, L=100, S=100, D=80, Dv=48, block=(32, 64)),
]

GPU_SHAPES = [
    Shape("gpu_1k", B=2, Hq=4, Hkv=4, L=1024, S=1024, D=128, Dv=128, block=128),
    Shape("gpu_ragged", B=1, Hq=4, Hkv=4, L=1000, S=1531, D=64, Dv=64, block=128),
    Shape("gpu_gqa", B=1, Hq=16, Hkv=4, L=2048, S=2048, D=128, Dv=128, block=128),
    Shape("gpu_d80", B=1, Hq=2, Hkv=2, L=777, S=777, D=80, Dv=48, block=128),
    Shape("gpu_d256", B=1, Hq=2, Hkv=2, L=1024, S=1024, D=256, Dv=256, block=128),
    Shape("gpu_8k", B=1, Hq=2, Hkv=2, L=8192, S=8192, D=128, Dv=128, block=128),
]


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_mods(name: str, shape: Shape, device, generator=None):
    """Return (score_mod, mask_mod) for the named variant at this shape."""
    L, S, B, H = shape.L, shape.S, shape.B, shape.Hq
    # Cross attention aligns the query block to the end of the keys, as decoding does.
    offset = S - L

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    if name == "noop":
        return None, None
    if name == "causal":
        return None, causal
    if name == "sliding_window":
        window = max(8, S // 5)

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx + offset - kv_idx) <= window

        return None, and_masks(causal, sliding_window)
    if name == "prefix_lm":
        prefix = torch.randint(1, max(2, S // 2), (B,), generator=generator, device="cpu").to(device)

        def prefix_mask(b, h, q_idx, kv_idx):
            return kv_idx < prefix[b]

        return None, or_masks(prefix_mask, causal)
    if name == "document":
        n = max(L, S)
        lengths = torch.randint(5, max(6, n // 3), (n,), generator=generator, device="cpu")
        doc_ids = torch.repeat_interleave(torch.arange(n), lengths)[:n].to(device)

        def document(b, h, q_idx, kv_idx):
            return doc_ids[q_idx + offset] == doc_ids[kv_idx]

        return None, and_masks(document, causal)
    if name == "alibi":
        slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + offset - kv_idx).abs()

        return alibi, causal
    if name == "softcap":
        def softcap(score, b, h, q_idx, kv_idx):
            return 3.0 * torch.tanh(score / 3.0)

        return softcap, None
    if name == "relative_table":
        table = torch.randn(L + S, generator=generator, device="cpu").to(device)

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[q_idx - kv_idx + S]

        return relative_bias, None
    if name == "and_or":
        def even(b, h, q_idx, kv_idx):
            return (kv_idx % 2) == 0

        def near(b, h, q_idx, kv_idx):
            return (q_idx + offset - kv_idx).abs() < 16

        return None, or_masks(and_masks(causal, even), near)
    if name == "stripes":  # not in MOD_NAMES: key blocks 0, 2, 4, ... full, the others empty (no run)
        width = shape.block if isinstance(shape.block, int) else shape.block[1]

        def stripes(b, h, q_idx, kv_idx):
            return (kv_idx // width) % 2 == 0

        return None, stripes
    raise KeyError(name)


def make_case(shape: Shape, mod_name: str, dtype, seed: int, device):
    """Fresh (q, k, v, score_mod, block_mask) for one test case (block_mask None: no mask_mod)."""
    from flexcore import create_block_mask

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (t.to(device) for t in shape.qkv(dtype, "cpu", gen))
    score_mod, mask_mod = make_mods(mod_name, shape, device, gen)
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, shape.B, None, shape.L, shape.S, device=device,
                               BLOCK_SIZE=shape.block)
    return q, k, v, score_mod, bm


MOD_NAMES = ["noop", "causal", "sliding_window", "prefix_lm", "document", "alibi", "softcap",
             "relative_table", "and_or"]
