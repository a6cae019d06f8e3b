"""Classify BlockMask blocks on the GPU by running the lowered mask_mod in a Triton kernel."""
from __future__ import annotations

import torch

from flexcore.kernels.codegen import load_kernel_module
from flexcore.kernels.launch import run


def classify_blocks(mask_lowered, B: int, H: int, Q_LEN: int, KV_LEN: int,
                    block_size: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Block map (B, H, cdiv(Q_LEN, BQ), cdiv(KV_LEN, BK)) int8: 0 empty, 1 partial, 2 full.

    Positions past Q_LEN / KV_LEN are ignored. Memory is the block map alone, so a 1M-token mask
    needs (2^20/128)^2 bytes per (batch, head).
    """
    from flexcore.lowering import lower_score_mod

    BQ, BK = block_size
    QB, KB = -(-Q_LEN // BQ), -(-KV_LEN // BK)
    if QB > 65535 or B * H > 65535:
        raise ValueError(f"too many query blocks ({QB}) or batch*heads ({B * H}) for one launch")
    module = load_kernel_module("blockmask.py.tmpl", lower_score_mod(None), mask_lowered)
    out = torch.empty((B, H, QB, KB), dtype=torch.int8, device=device)
    kv_pad = max(16, 1 << (BK - 1).bit_length())
    # Strips of about 4K positions keep registers bounded for any block size.
    sub_q = max(1, min(1 << (BQ - 1).bit_length(), 4096 // kv_pad))
    run(module.classify_blocks_kernel, (KB, QB, B * H),
        (out, *out.stride(), Q_LEN, KV_LEN, H, *mask_lowered.kernel_args()),
        dict(BLOCK_Q=BQ, BLOCK_KV=BK, BLOCK_KV_PAD=kv_pad, SUB_Q=sub_q))
    return out
