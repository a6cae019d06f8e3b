"""Mods made dense for providers without mods: boolean masks, additive biases, and recognised shapes.

SDPA takes a dense ``attn_mask`` (bool, or a float bias in the query dtype); the flash_attn package
takes ``causal``, ``window_size``, ``softcap`` and ``alibi_slopes``. This module evaluates the mods on
index grids (broadcast: a mask that ignores b and h is built once as (1, 1, Lq, Lk)) and recognises
those shapes numerically, so any variant that one of them can express is expressed, and the others
are skipped with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class NotExpressible(Exception):
    """The variant cannot be given to this provider; the message says why."""


def _idx(n: int, dim: int, device) -> torch.Tensor:
    shape = [1, 1, 1, 1]
    shape[dim] = n
    return torch.arange(n, device=device, dtype=torch.int64).view(shape)


def broadcast_dims(fn, is_score: bool, B: int, H: int, device) -> tuple[int, int]:
    """(B or 1, H or 1): whether the mod's value varies with the batch index and the head index."""
    b, h = _idx(B, 0, device), _idx(H, 1, device)
    q, kv = _idx(2, 2, device), _idx(2, 3, device)
    with torch.no_grad():
        out = fn(torch.zeros(1, 1, 2, 2, device=device), b, h, q, kv) if is_score else fn(b, h, q, kv)
    out = torch.as_tensor(out)
    shape = (1,) * (4 - out.dim()) + tuple(out.shape)
    return (B if shape[0] == B and B > 1 else 1), (H if shape[1] == H and H > 1 else 1)


def dense_bytes(dims: tuple[int, int], Lq: int, Lk: int, itemsize: int) -> int:
    return dims[0] * dims[1] * Lq * Lk * itemsize


def _chunk_rows(Lk: int, n_bh: int, target: int = 1 << 26) -> int:
    return max(1, min(4096, target // max(1, Lk * n_bh)))


def dense_mask(mask_mod, B: int, H: int, Lq: int, Lk: int, device, budget_bytes: int | None = None
               ) -> torch.Tensor:
    """Boolean mask (B or 1, H or 1, Lq, Lk), True where attended; built in chunks of query rows."""
    dims = broadcast_dims(mask_mod, False, B, H, device)
    need = dense_bytes(dims, Lq, Lk, 1)
    if budget_bytes is not None and need > budget_bytes:
        raise NotExpressible(f"dense mask of shape {(*dims, Lq, Lk)} needs {need / 2**30:.1f} GiB, over "
                             f"the mask budget of {budget_bytes / 2**30:.1f} GiB (settings.mask_budget_gb)")
    out = torch.empty(*dims, Lq, Lk, dtype=torch.bool, device=device)
    b, h, kv = _idx(dims[0], 0, device), _idx(dims[1], 1, device), _idx(Lk, 3, device)
    step = _chunk_rows(Lk, dims[0] * dims[1])
    with torch.no_grad():
        for start in range(0, Lq, step):
            q = _idx(min(step, Lq - start), 2, device) + start
            out[:, :, start:start + q.shape[2]] = torch.as_tensor(mask_mod(b, h, q, kv)).to(torch.bool)
    return out


def check_additive(score_mod, B: int, H: int, Lq: int, Lk: int, device, samples: int = 4096,
                   seed: int = 0) -> None:
    """Raise NotExpressible unless ``score_mod(s) - s`` does not depend on ``s`` (an additive bias).

    Checked on random index points and random scores of two magnitudes.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def pick(n):
        return torch.randint(0, n, (samples,), generator=gen).to(device)

    b, h, q, kv = pick(B), pick(H), pick(Lq), pick(Lk)
    with torch.no_grad():
        zero = torch.as_tensor(score_mod(torch.zeros(samples, device=device), b, h, q, kv)).float()
        for scale in (1.0, 40.0):
            s = torch.randn(samples, generator=gen).to(device) * scale
            out = torch.as_tensor(score_mod(s, b, h, q, kv)).float()
            diff = (out - s) - zero
            finite = torch.isfinite(zero) & torch.isfinite(out)
            if not torch.equal(torch.isfinite(zero), torch.isfinite(out)) or \
                    (diff[finite].abs() > 1e-3 * (1 + zero[finite].abs() + s[finite].abs())).any():
                name = getattr(score_mod, "__name__", "score_mod")
                raise NotExpressible(f"score_mod {name} is not an additive bias (score_mod(s) - s "
                                     "depends on s), so no dense bias can express it")


def is_trivial_score(score_mod, B: int, H: int, Lq: int, Lk: int, device, samples: int = 1024) -> bool:
    """True when the score_mod returns its score unchanged (on random points)."""
    if score_mod is None:
        return True
    gen = torch.Generator(device="cpu").manual_seed(1)
    idx = [torch.randint(0, n, (samples,), generator=gen).to(device) for n in (B, H, Lq, Lk)]
    s = torch.randn(samples, generator=gen).to(device) * 10
    with torch.no_grad():
        out = torch.as_tensor(score_mod(s, *idx)).float()
    return bool(torch.equal(out.expand_as(s), s))


def dense_bias(score_mod, mask_mod, B: int, H: int, Lq: int, Lk: int, device, dtype,
               budget_bytes: int | None = None, grad: bool = False) -> torch.Tensor:
    """Float bias (B or 1, H or 1, Lq, Lk) in ``dtype``: ``score_mod(0, ...)``, -inf where masked.

    With ``grad=True`` the bias is built in one piece with autograd, so that gradients reach the
    score_mod's captured tensors (use it on small slices only).
    """
    check_additive(score_mod, B, H, Lq, Lk, device)
    dims_s = broadcast_dims(score_mod, True, B, H, device)
    dims_m = broadcast_dims(mask_mod, False, B, H, device) if mask_mod is not None else (1, 1)
    dims = (max(dims_s[0], dims_m[0]), max(dims_s[1], dims_m[1]))
    need = dense_bytes(dims, Lq, Lk, torch.tensor([], dtype=dtype).element_size())
    if budget_bytes is not None and need > budget_bytes:
        raise NotExpressible(f"dense bias of shape {(*dims, Lq, Lk)} needs {need / 2**30:.1f} GiB, over "
                             f"the mask budget of {budget_bytes / 2**30:.1f} GiB (settings.mask_budget_gb)")
    b, h, kv = _idx(dims[0], 0, device), _idx(dims[1], 1, device), _idx(Lk, 3, device)

    def rows(start, n):
        q = _idx(n, 2, device) + start
        bias = torch.as_tensor(score_mod(torch.zeros(1, 1, n, Lk, device=device), b, h, q, kv))
        bias = bias.float().expand(*dims, n, Lk)
        if mask_mod is not None:
            keep = torch.as_tensor(mask_mod(b, h, q, kv)).to(torch.bool)
            bias = bias.masked_fill(~keep, float("-inf"))
        return bias.to(dtype)

    if grad:
        return rows(0, Lq)
    out = torch.empty(*dims, Lq, Lk, dtype=dtype, device=device)
    step = _chunk_rows(Lk, dims[0] * dims[1])
    with torch.no_grad():
        for start in range(0, Lq, step):
            n = min(step, Lq - start)
            out[:, :, start:start + n] = rows(start, n)
    return out


@dataclass(frozen=True)
class MaskShape:
    """A mask recognised as (no mask | causal | causal sliding window), aligned at ``offset``.

    ``offset`` = 0: query i sees keys ≤ i (top-left, SDPA's is_causal); ``offset`` = Lk - Lq:
    bottom-right (flash_attn's causal, and decoding). ``window``: keys within ``window - 1`` behind.
    """

    kind: str  # "none", "causal", "window", "other"
    offset: int = 0
    window: int | None = None


def classify_mask(mask: torch.Tensor | None, Lq: int, Lk: int) -> MaskShape:
    """Recognise a dense boolean mask (from :func:`dense_mask`), or None for no mask."""
    if mask is None or bool(mask.all()):
        return MaskShape("none")
    if mask.shape[0] != 1 or mask.shape[1] != 1:
        return MaskShape("other")
    m = mask[0, 0]
    device = m.device
    q = torch.arange(Lq, device=device).view(Lq, 1)
    kv = torch.arange(Lk, device=device).view(1, Lk)
    for offset in sorted({0, Lk - Lq}):
        causal = kv <= q + offset
        if torch.equal(m, causal):
            return MaskShape("causal", offset)
        width = int(m[-1].sum())  # the last query row is never clipped by the sequence start
        if width > 0 and torch.equal(m, causal & (q + offset - kv < width)):
            return MaskShape("window", offset, width)
    return MaskShape("other")


def alibi_slopes(score_mod, mask: MaskShape, B: int, H: int, Lq: int, Lk: int, device,
                 samples: int = 4096) -> torch.Tensor | None:
    """Per-head slopes if ``score_mod(s) = s - slope[h]·(q + offset - kv)`` on the attended keys, else None."""
    if mask.kind not in ("causal", "window"):
        return None
    try:
        check_additive(score_mod, B, H, Lq, Lk, device)
    except NotExpressible:
        return None
    hs = torch.arange(H, device=device)
    q1 = torch.full((H,), max(1, Lq - 1), device=device)
    kv1 = q1 + mask.offset - 1
    with torch.no_grad():
        zero = torch.zeros(H, device=device)
        at0 = torch.as_tensor(score_mod(zero, torch.zeros_like(hs), hs, q1, q1 + mask.offset)).float()
        at1 = torch.as_tensor(score_mod(zero, torch.zeros_like(hs), hs, q1, kv1)).float()
        slopes = (at0 - at1).expand(H).clone()
        gen = torch.Generator(device="cpu").manual_seed(2)
        b = torch.randint(0, B, (samples,), generator=gen).to(device)
        h = torch.randint(0, H, (samples,), generator=gen).to(device)
        q = torch.randint(0, Lq, (samples,), generator=gen).to(device)
        back = torch.randint(0, Lk, (samples,), generator=gen).to(device)
        kv = torch.clamp(q + mask.offset - back, min=0)
        got = torch.as_tensor(score_mod(torch.zeros(samples, device=device), b, h, q, kv)).float()
        want = -slopes[h] * (q + mask.offset - kv).float()
    if not torch.allclose(got.expand_as(want), want, rtol=1e-4, atol=1e-4):
        return None
    return slopes.float()


def softcap_value(score_mod, B: int, H: int, Lq: int, Lk: int, device, samples: int = 1024) -> float | None:
    """``cap`` if ``score_mod(s) = cap·tanh(s / cap)`` everywhere (on random points), else None."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    idx = [torch.randint(0, n, (samples,), generator=gen).to(device) for n in (B, H, Lq, Lk)]
    with torch.no_grad():
        big = torch.as_tensor(score_mod(torch.full((samples,), 1e6, device=device), *idx)).float()
        cap = float(big.max())
        if not (0 < cap < 1e5) or not torch.allclose(big, torch.full_like(big, cap), rtol=1e-5):
            return None
        s = torch.randn(samples, generator=gen).to(device) * cap
        got = torch.as_tensor(score_mod(s, *idx)).float()
        if not torch.allclose(got, cap * torch.tanh(s / cap), rtol=1e-4, atol=1e-4):
            return None
    return cap
