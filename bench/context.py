"""One setup factory per case: inputs, mods, masks and the float64 golden that every provider shares."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from bench import dense
from bench.flops import attention_flops, block_density, decode_bytes
from bench.grid import FP8_PASS, Case, Settings
from bench.mods import offset_indices, resolve
from variants.core import Mods


@dataclass
class FP8Inputs:
    """An input set quantized for the fp8 pass: float8_e4m3fn q, k, v and their float32 descales,
    (B, Hkv) each (q's per batch and KV head: FlashAttention-3's layout, which flexcore takes too)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale_q: torch.Tensor
    descale_k: torch.Tensor
    descale_v: torch.Tensor

    def descales(self) -> dict:
        """The descales as flex_attention's keyword arguments."""
        return dict(descale_q=self.descale_q, descale_k=self.descale_k, descale_v=self.descale_v)


@dataclass
class InputSet:
    """One rotated input set. For the fp8 pass q, k, v hold the dequantized values of ``fp8``
    (exact in bfloat16), so that the float64 golden and the baselines attend what FP8 providers do."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None
    fp8: FP8Inputs | None = None


@dataclass
class Slice:
    """A block of the problem checked against float64: batches ``b .. b + nb`` and KV heads
    ``kv_head .. kv_head + nkv`` with their query heads ``h0 .. h0 + nq`` (whole GQA groups, so that
    dK and dV of the slice are complete)."""

    b: int
    nb: int
    kv_head: int
    nkv: int
    h0: int
    nq: int

    def q_part(self, t: torch.Tensor) -> torch.Tensor:
        """The slice of a (B, Hq, ...) tensor."""
        return t[self.b:self.b + self.nb, self.h0:self.h0 + self.nq]

    def kv_part(self, t: torch.Tensor) -> torch.Tensor:
        """The slice of a (B, Hkv, ...) tensor."""
        return t[self.b:self.b + self.nb, self.kv_head:self.kv_head + self.nkv]


@dataclass
class CaseContext:
    """Everything the providers of one case share; expensive parts are built on first use.

    The inputs follow the case's layout (B, H, L, D). For decoding the mods see the query at
    position ``KV_LEN - Q_LEN`` (see :func:`bench.mods.offset_indices`).
    """

    case: Case
    settings: Settings
    device: torch.device
    mods: Mods
    inputs: list[InputSet] = field(default_factory=list)
    _cache: dict = field(default_factory=dict)

    # ---- shapes and work -------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.case.torch_dtype()

    @property
    def needs_grad(self) -> bool:
        return self.case.pass_ == "fwd_bwd"

    @property
    def learnable_named(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of captured tensors that require grad, and the attention sinks ("sinks")
        when they require grad: their gradients are compared."""
        named = list(self.mods.learnable.items())
        sinks = self.mods.sinks
        if sinks is not None and sinks.requires_grad and all(t is not sinks for _, t in named):
            named.append(("sinks", sinks))
        return named

    @property
    def learnable(self) -> list[torch.Tensor]:
        return [t for _, t in self.learnable_named]

    def mask_dims(self) -> tuple[int, int]:
        if self.mods.mask_mod is None:
            return 1, 1
        return self._cached("mask_dims", lambda: dense.broadcast_dims(
            self.mods.mask_mod, False, self.case.batch, self.case.q_heads, self.device))

    def flex_block_mask(self):
        """flexcore's BlockMask of the mask_mod (None when there is no mask)."""
        if self.mods.mask_mod is None:
            return None

        def build():
            from flexcore import create_block_mask

            c = self.case
            mb, mh = self.mask_dims()
            return create_block_mask(self.mods.mask_mod, mb if mb > 1 else None, mh if mh > 1 else None,
                                     c.q_len, c.kv_len, device=self.device,
                                     BLOCK_SIZE=self.settings.block_size)

        return self._cached("flex_block_mask", build)

    def density(self) -> float:
        """Fraction of BLOCK_SIZE blocks computed (FLOP convention of docs/benchmark-method.md), from flexcore's
        BlockMask, or torch's when flexcore cannot build one (so that other providers still get
        their TFLOP/s)."""
        if self.mods.mask_mod is None:
            return 1.0

        def build():
            try:
                return block_density(self.flex_block_mask())
            except Exception:
                from torch.nn.attention.flex_attention import create_block_mask

                c = self.case
                mb, mh = self.mask_dims()
                return block_density(create_block_mask(
                    self.mods.mask_mod, mb if mb > 1 else None, mh if mh > 1 else None, c.q_len,
                    c.kv_len, device=self.device, BLOCK_SIZE=self.settings.block_size))

        return self._cached("density", build)

    @property
    def fp8(self) -> bool:
        """Whether the case is the FP8 forward (:data:`bench.grid.FP8_PASS`)."""
        return self.case.pass_ == FP8_PASS

    def fp8_inputs(self, q: torch.Tensor) -> FP8Inputs:
        """The quantized inputs of the input set whose (dequantized) q is ``q`` (providers look
        them up by the tensor the runner passes, so quantization stays out of the timed call)."""
        for x in self.inputs:
            if x.q is q and x.fp8 is not None:
                return x.fp8
        raise KeyError("no FP8 input set holds this query tensor (the fp8 pass's providers take "
                       "the context's own input sets)")

    def flops(self) -> float:
        c = self.case
        return attention_flops(c.batch, c.q_heads, c.q_len, c.kv_len, c.head_dim, c.v_head_dim,
                               self.density(), "fwd" if self.fp8 else c.pass_)

    def bytes_moved(self) -> float:
        c = self.case
        return decode_bytes(c.batch, c.kv_heads, c.kv_len, c.head_dim, c.v_head_dim,
                            torch.tensor([], dtype=self.dtype).element_size(), self.density())

    # ---- dense forms for providers without mods --------------------------------------------
    def budget_bytes(self) -> int:
        return int(self.settings.mask_budget_gb * 2**30)

    def dense_mask(self):
        """Dense boolean mask, or None without a mask_mod; raises NotExpressible over budget."""
        if self.mods.mask_mod is None:
            return None
        c = self.case
        return self._cached("dense_mask", lambda: dense.dense_mask(
            self.mods.mask_mod, c.batch, c.q_heads, c.q_len, c.kv_len, self.device, self.budget_bytes()))

    def mask_shape(self) -> dense.MaskShape:
        def build():
            try:
                return dense.classify_mask(self.dense_mask(), self.case.q_len, self.case.kv_len)
            except dense.NotExpressible:
                return dense.MaskShape("other")

        return self._cached("mask_shape", build)

    def score_is_trivial(self) -> bool:
        c = self.case
        return self._cached("score_trivial", lambda: dense.is_trivial_score(
            self.mods.score_mod, c.batch, c.q_heads, c.q_len, c.kv_len, self.device))

    def dense_bias(self):
        """Dense additive bias in the case dtype (-inf where masked); raises NotExpressible."""
        c = self.case
        return self._cached("dense_bias", lambda: dense.dense_bias(
            self.mods.score_mod, self.mods.mask_mod, c.batch, c.q_heads, c.q_len, c.kv_len,
            self.device, self.dtype, self.budget_bytes()))

    def _cached(self, key, build):
        if key not in self._cache:
            try:
                self._cache[key] = ("ok", build())
            except Exception as exc:  # remember failures too, so that each is raised once per case
                self._cache[key] = ("error", exc)
        status, value = self._cache[key]
        if status == "error":
            raise value
        return value

    def release(self) -> None:
        """Drop cached tensors (dense masks can be GiBs) before the next case."""
        self._cache.clear()
        self.inputs.clear()

    # ---- the float64 golden ----------------------------------------------------------------
    def slices(self) -> list[Slice]:
        """The slices checked against float64: the whole problem when it is small (scores and
        repeated K/V within ``settings.ref_full_elements``) or ``ref_slices`` is 0, else
        ``ref_slices`` single (batch, kv-head) slices spread evenly."""
        c = self.case
        group = c.q_heads // c.kv_heads
        pairs = [(b, kvh) for b in range(c.batch) for kvh in range(c.kv_heads)]
        n = self.settings.ref_slices
        # The reference repeats K/V per query head and works in float64: bound that as well as
        # the scores, or a long decode (B·Hq·Lk·D in float64) alone would fill the memory.
        small = max(c.batch * c.q_heads * c.q_len * c.kv_len,
                    c.batch * c.q_heads * c.kv_len * (c.head_dim + c.v_head_dim)) \
            <= self.settings.ref_full_elements
        if n <= 0 or n >= len(pairs) or small:
            return [Slice(0, c.batch, 0, c.kv_heads, 0, c.q_heads)]
        step = (len(pairs) - 1) / max(1, n - 1)
        chosen = sorted({pairs[round(i * step)] for i in range(n)})
        return [Slice(b, 1, kvh, 1, kvh * group, group) for b, kvh in chosen]

    def coverage(self) -> str:
        """Text for the results: which part of the output the errors are computed on."""
        slices = self.slices()
        c = self.case
        if len(slices) == 1 and slices[0].nb == c.batch and slices[0].nq == c.q_heads:
            return "all"
        return ";".join(f"b{s.b}/h{s.h0}:{s.h0 + s.nq}" for s in slices)

    def slice_mods(self, s: Slice) -> Mods:
        """The mods of a slice: indices offset to the slice, and the slice's query heads' sinks."""
        mods = offset_indices(self.mods, b0=s.b, h0=s.h0)
        if mods.sinks is not None:
            mods = dataclasses.replace(mods, sinks=mods.sinks[s.h0:s.h0 + s.nq])
        return mods

    def slice_tensors(self, s: Slice, q, k, v):
        return s.q_part(q), s.kv_part(k), s.kv_part(v)

    def slice_block_mask(self, s: Slice, mods: Mods):
        if mods.mask_mod is None:
            return None
        from flexcore import create_block_mask

        mb, mh = self.mask_dims()
        return create_block_mask(mods.mask_mod, s.nb if mb > 1 else None, s.nq if mh > 1 else None,
                                 self.case.q_len, self.case.kv_len, device=self.device,
                                 BLOCK_SIZE=self.settings.block_size)

    def correctness_dout(self) -> torch.Tensor | None:
        """The output gradient of the correctness run: zero outside the checked slices, so that every
        gradient (including captured tensors') is exactly that of the checked slices."""
        if not self.needs_grad:
            return None

        def build():
            dout = self.inputs[0].dout
            if self.coverage() == "all":
                return dout
            masked = torch.zeros_like(dout)
            for s in self.slices():
                s.q_part(masked).copy_(s.q_part(dout))
            return masked

        return self._cached("correctness_dout", build)

    def golden(self) -> dict:
        """float64 outputs and gradients on the checked slices: {"out": [...], "dq": [...], ...,
        "captured": [per learnable tensor]} (lists follow :meth:`slices`)."""
        return self._cached("golden", lambda: self._reference(upcast=True))

    def _reference(self, upcast: bool) -> dict:
        from flexcore.reference import flex_attention_reference

        first = self.inputs[0]
        result = {"out": [], "dq": [], "dk": [], "dv": []}
        learnable = self.learnable
        cap_grads = [None] * len(learnable)
        dout = self.correctness_dout()
        for s in self.slices():
            mods = self.slice_mods(s)
            q, k, v = self.slice_tensors(s, first.q, first.k, first.v)
            descales = {}
            if upcast:  # for fp8 the dequantized values (exact in bfloat16): the float64 golden
                q, k, v = (t.detach().double() for t in (q, k, v))
            elif self.fp8:  # the FP8 kernels' math (flexcore.reference): the same-dtype baseline
                x = first.fp8
                q, k, v = self.slice_tensors(s, x.q, x.k, x.v)
                descales = {name: s.kv_part(d) for name, d in x.descales().items()}
            else:
                q, k, v = (t.detach() for t in (q, k, v))
            with torch.set_grad_enabled(self.needs_grad):
                if self.needs_grad:
                    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
                out = flex_attention_reference(q, k, v, score_mod=mods.score_mod,
                                               block_mask=self.slice_block_mask(s, mods),
                                               enable_gqa=s.nq != s.nkv, upcast=upcast,
                                               sinks=mods.sinks, **descales)
                if self.needs_grad:
                    g = s.q_part(dout).to(out.dtype)
                    grads = torch.autograd.grad(out, [q, k, v, *learnable], g, allow_unused=True)
                    for name, grad in zip(("dq", "dk", "dv"), grads[:3]):
                        result[name].append(grad.detach())
                    for i, grad in enumerate(grads[3:]):
                        if grad is not None:
                            grad = grad.detach().double()
                            cap_grads[i] = grad if cap_grads[i] is None else cap_grads[i] + grad
            result["out"].append(out.detach())
        result["captured"] = [g if g is not None else torch.zeros_like(t, dtype=torch.float64)
                              for g, t in zip(cap_grads, learnable)]
        return result

    def reference_baseline(self) -> dict:
        """flexcore's eager reference in the case dtype (``upcast=False``): the same-dtype baseline when
        SDPA math cannot express the variant, and for the fp8 pass (FP8 kernels' math on the
        quantized inputs: probabilities rounded to e4m3 before @ V)."""
        return self._cached("ref_baseline", lambda: self._reference(upcast=False))


def make_context(case: Case, settings: Settings, device: torch.device, n_sets: int | None = None,
                 mods: Mods | None = None) -> CaseContext:
    """Build a case's context: the mods (``mods``, or the case's variant spec resolved), and the
    rotated input sets (seeded)."""
    c = case
    if mods is None:
        mods = resolve(c.variant, B=c.batch, H=c.q_heads, KV_HEADS=c.kv_heads, Q_LEN=c.q_len,
                       KV_LEN=c.kv_len, D=c.head_dim, device=device, dtype=c.torch_dtype())
    if c.pass_ == "decode":
        mods = offset_indices(mods, q0=c.kv_len - c.q_len)
    ctx = CaseContext(c, settings, device, mods)
    # Seeded per case; on the GPU the generator lives there (CPU randn of 65k-token KV is slow).
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(settings.seed + _stable_hash(c.case_id))
    dtype = c.torch_dtype()
    set_bytes = (c.batch * c.q_heads * c.q_len * c.head_dim + c.batch * c.kv_heads * c.kv_len
                 * (c.head_dim + c.v_head_dim)) * torch.tensor([], dtype=dtype).element_size()
    if n_sets is None:
        n_sets = rotation_sets(set_bytes, device)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=gen_device, dtype=torch.float32).to(
            device=device, dtype=dtype)

    for _ in range(n_sets):
        q = randn(c.batch, c.q_heads, c.q_len, c.head_dim)
        k = randn(c.batch, c.kv_heads, c.kv_len, c.head_dim)
        v = randn(c.batch, c.kv_heads, c.kv_len, c.v_head_dim)
        dout = randn(c.batch, c.q_heads, c.q_len, c.v_head_dim) if c.pass_ == "fwd_bwd" else None
        if c.pass_ == "fwd_bwd":
            for t in (q, k, v):
                t.requires_grad_(True)
        if c.pass_ == FP8_PASS:
            ctx.inputs.append(fp8_input_set(q, k, v, c.kv_heads))
        else:
            ctx.inputs.append(InputSet(q, k, v, dout))
    return ctx


def fp8_input_set(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> InputSet:
    """An fp8 pass's input set: q, k, v quantized to float8_e4m3fn with descales from each
    (batch, KV head)'s amax (q's over its GQA group: FlashAttention-3's layout), rounded up to
    powers of two so that the dequantized values, which the set's q, k, v hold in bfloat16, are
    exact (e4m3's relative precision is the same in every binade, so nothing is lost but the top
    binade's range)."""
    from flexcore.fp8 import dequantize, quantize

    (q8, dq), (k8, dk), (v8, dv) = (quantize(t, heads=kv_heads, power_of_two=True) for t in (q, k, v))
    fp8 = FP8Inputs(q8, k8, v8, dq, dk, dv)
    return InputSet(*(dequantize(t, d, q.dtype) for t, d in ((q8, dq), (k8, dk), (v8, dv))), None, fp8)


def rotation_sets(set_bytes: int, device: torch.device, cap: int = 4) -> int:
    """How many input sets to rotate so that together they exceed twice the L2 cache (at most ``cap``)."""
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    else:
        l2 = 32 << 20
    return max(1, min(cap, math.ceil(2 * l2 / max(1, set_bytes))))


@functools.lru_cache(maxsize=None)
def _stable_hash(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode()) % (2**31)
