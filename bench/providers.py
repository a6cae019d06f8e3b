"""Attention providers the runner compares: flexlab, torch flex_attention (Triton and FLASH backends),
SDPA backends, flash_attn and FlashAttention-4.

Each provider says whether it runs on this machine (``available``) and turns a case into a call
(``prepare``), so that building masks and compiling happen before timing. A provider that cannot
express a variant raises :class:`Unsupported` with the reason, which the results keep.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench import dense
from bench.context import CaseContext


class Unsupported(Exception):
    """This provider cannot run this case; the message says why (kept in the results)."""


@dataclass
class Prepared:
    """A provider's call for one case.

    Attributes:
        call: ``call(q, k, v) -> out`` with the case's (B, H, L, D) layout.
        held_bytes: memory the provider holds for the case (dense masks, BlockMask tables),
            added to the per-call peak.
        note: how the variant was expressed (e.g. "dense bool mask (1, 1, 4096, 4096)").
        grad_call: like ``call``, but lets gradients reach the variant's learnable captured
            tensors (defaults to ``call``); used by the correctness run only.
        timing_grad_targets: extra tensors whose gradients a timed backward requests (a dense bias
            standing in for learnable captured tensors).
    """

    call: Callable
    held_bytes: int = 0
    note: str = ""
    grad_call: Callable | None = None
    timing_grad_targets: list = field(default_factory=list)


class Provider:
    name = "provider"
    #: The passes this provider measures (None: all); other cases get no rows from it.
    passes: tuple[str, ...] | None = None
    description = ""

    def available(self, device: torch.device) -> tuple[bool, str]:
        """(True, what runs) or (False, why not) on this machine."""
        raise NotImplementedError

    def prepare(self, ctx: CaseContext) -> Prepared:
        """The call for one case; raises :class:`Unsupported` when the provider cannot express it."""
        raise NotImplementedError


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _block_mask_bytes(bm) -> int:
    if bm is None:
        return 0
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
             "q_indices", "full_q_num_blocks", "full_q_indices")
    return _tensor_bytes(*(getattr(bm, n, None) for n in names))


def _sinks_note(ctx: CaseContext, how: str) -> str:
    """The rows' note on how the case's attention sinks were applied ("" without sinks)."""
    return "" if ctx.mods.sinks is None else f"sinks applied by {how}"


def refuse_sinks(ctx: CaseContext, what: str) -> None:
    """Raise :class:`Unsupported` when the case has attention sinks, which ``what`` cannot apply."""
    if ctx.mods.sinks is not None:
        raise Unsupported(f"{what} has no attention sinks (the variant passes sinks= of shape "
                          f"{tuple(ctx.mods.sinks.shape)}); only flex_attention providers apply them")


def refuse_fp8(ctx: CaseContext, what: str) -> None:
    """Raise :class:`Unsupported` on the fp8 pass, whose float8_e4m3fn inputs ``what`` does not take
    (``what`` completes "... takes no float8 inputs" with its reason)."""
    if ctx.fp8:
        raise Unsupported(f"{what}: the fp8 pass attends float8_e4m3fn q, k, v with descales")


#: How torch flex_attention providers apply a case's sinks (torch's flex_attention takes none).
TORCH_SINKS_NOTE = "sinks applied after the call by LSE renormalisation"


def flex_attention_with_sinks(q, k, v, sinks, *, flex_attention=None, **kwargs) -> torch.Tensor:
    """torch's flex_attention (or ``flex_attention``, a function of the same signature) with
    ``sinks`` applied to the call's own (out, lse) by the LSE renormalisation that users of torch's
    flex_attention write, ``out · exp(lse - logaddexp(lse, sink[h]))`` (flexcore.sinks.apply_sinks)."""
    from flexcore.sinks import apply_sinks

    from torch.nn.attention import flex_attention as fa

    fn = flex_attention or fa.flex_attention
    if hasattr(fa, "AuxRequest"):
        out, aux = fn(q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    else:
        out, lse = fn(q, k, v, return_lse=True, **kwargs)
    return apply_sinks(out, lse, sinks)[0]


# ---- flexlab ---------------------------------------------------------------------------------


#: How the fp8 pass's providers are called (bench.context.fp8_input_set quantizes outside the timing).
FP8_NOTE = ("float8_e4m3fn q, k, v with per-(batch, KV head) descales from amax (powers of two), "
            "bfloat16 output")


class FlexlabProvider(Provider):
    name = "flexlab"
    description = "flexcore.flex_attention: flexlab's fused Triton kernels"

    def available(self, device):
        try:
            importlib.import_module("flexcore.attention")
            importlib.import_module("flexcore.blockmask")
        except Exception as exc:
            return False, f"flexcore cannot be imported: {type(exc).__name__}: {exc}"
        from flexcore._runtime import use_interpreter

        if device.type == "cuda":
            return True, "flexcore Triton kernels on the GPU"
        if use_interpreter():
            return True, "flexcore Triton kernels under Triton's interpreter (CPU; slow, for correctness)"
        return False, "flexcore runs on CUDA or under TRITON_INTERPRET=1"

    def prepare(self, ctx):
        from flexcore import flex_attention

        bm = ctx.flex_block_mask()
        score_mod, sinks = ctx.mods.score_mod, ctx.mods.sinks
        gqa = ctx.case.gqa

        if ctx.fp8:
            def call(q, k, v):  # the set's quantized tensors, quantized before timing
                x = ctx.fp8_inputs(q)
                return flex_attention(x.q, x.k, x.v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                      sinks=sinks, **x.descales())
        else:
            def call(q, k, v):
                return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                      sinks=sinks)

        note = "; ".join(filter(None, ["flexcore BlockMask" if bm is not None else "",
                                       FP8_NOTE if ctx.fp8 else "",
                                       _sinks_note(ctx, "flex_attention(..., sinks=)")]))
        return Prepared(call, _block_mask_bytes(bm), note)


class FlexlabCompiledProvider(Provider):
    """flexcore.flex_attention called inside ``torch.compile(fullgraph=True)``, as a model compiled
    for training calls it. A compile failure is an error row whose note gives Dynamo's reason."""

    name = "flexlab_compiled"
    description = "flexcore.flex_attention inside torch.compile(fullgraph=True)"

    def available(self, device):
        ok, why = FlexlabProvider().available(device)
        return ok, (f"{why}, inside torch.compile(fullgraph=True)" if ok else why)

    def prepare(self, ctx):
        import flexcore

        refuse_fp8(ctx, "flexcore's FP8 path runs eagerly, not under torch.compile")
        bm = ctx.flex_block_mask()
        score_mod, sinks = ctx.mods.score_mod, ctx.mods.sinks
        gqa = ctx.case.gqa
        backend = ctx.settings.compile_backend
        raise_recompile_limits()
        compiled = torch.compile(
            lambda q, k, v: flexcore.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                    enable_gqa=gqa, sinks=sinks),
            fullgraph=True, dynamic=False, backend=backend)

        def call(q, k, v):
            try:
                return compiled(q, k, v)
            except Exception as exc:
                if not is_compile_error(exc):
                    raise
                raise CompileFailed(f"torch.compile(fullgraph=True, backend={backend}) of "
                                    f"flexcore.flex_attention failed: {compile_failure_text(exc)}") from exc

        note = "; ".join(filter(None, [f"torch.compile(fullgraph=True, backend={backend})",
                                       "flexcore BlockMask" if bm is not None else "",
                                       _sinks_note(ctx, "flex_attention(..., sinks=)")]))
        return Prepared(call, _block_mask_bytes(bm), note)


class FlexlabPagedProvider(Provider):
    """flexcore decoding over a paged KV cache (:class:`flexcore.PagedAttention`), pages scattered.

    Each rotated input set's K/V are written into their own physical cache of ``block_size``-token
    pages, reserved in four interleaved rounds so that every sequence's pages are spread over the
    cache; the call reads the physical cache through the converted BlockMask. Compare its time with
    ``flexlab`` on the same case (the contiguous cache).
    """

    name = "flexlab_paged"
    description = "flexcore decoding over a paged KV cache (page size = BLOCK_SIZE, pages scattered)"
    passes = ("decode",)

    def available(self, device):
        ok, why = FlexlabProvider().available(device)
        return ok, f"{why}; decode cases only, over a paged KV cache" if ok else why

    def prepare(self, ctx):
        from flexcore import create_block_mask, flex_attention, noop_mask
        from flexcore.paged import PagedAttention

        c = ctx.case
        if c.pass_ != "decode":
            raise Unsupported("the paged cache is measured on decode cases only")
        page = ctx.settings.block_size
        pages_per_seq = -(-c.kv_len // page)
        n_pages = c.batch * pages_per_seq
        paged = PagedAttention(n_pages, page, c.batch, device=ctx.device)
        for rnd in range(1, 5):
            for b in range(c.batch):
                paged.reserve(b, min(c.kv_len, -(-c.kv_len * rnd // 4)))
        batch_idx = torch.arange(c.batch, device=ctx.device)
        positions = torch.arange(c.kv_len, device=ctx.device).expand(c.batch, c.kv_len)
        caches = {}
        for x in ctx.inputs:
            k_cache = torch.zeros(1, c.kv_heads, n_pages * page, c.head_dim, device=ctx.device, dtype=ctx.dtype)
            v_cache = torch.zeros(1, c.kv_heads, n_pages * page, c.v_head_dim, device=ctx.device,
                                  dtype=ctx.dtype)
            paged.assign(batch_idx, positions, x.k.detach(), x.v.detach(), k_cache, v_cache)
            caches[id(x.k)] = (k_cache, v_cache)
        logical = ctx.flex_block_mask()
        if logical is None:
            logical = create_block_mask(noop_mask, None, None, c.q_len, c.kv_len, device=ctx.device,
                                        BLOCK_SIZE=page)
        physical = paged.convert_logical_block_mask(logical, batch_idx=batch_idx)
        score_mod = paged.get_score_mod(ctx.mods.score_mod)
        sinks = ctx.mods.sinks
        gqa = c.gqa

        def call(q, k, v):
            k_cache, v_cache = caches[id(k)]
            return flex_attention(q, k_cache, v_cache, score_mod=score_mod, block_mask=physical,
                                  enable_gqa=gqa, sinks=sinks)

        held = _block_mask_bytes(physical) + sum(_tensor_bytes(*kv) for kv in caches.values())
        note = "; ".join(filter(None, [f"{n_pages} pages of {page} tokens, reserved in 4 interleaved rounds",
                                       _sinks_note(ctx, "flex_attention(..., sinks=)")]))
        return Prepared(call, held, note)


# ---- torch flex_attention (compiled) ----------------------------------------------------------


def raise_recompile_limits() -> None:
    """Let one compiled function recompile for every case of a run.

    Every variant's mods are a new closure, so each case recompiles; the default limit of 8
    recompiles would silently fall back to eager code after eight variants."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 4096))


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    raise_recompile_limits()
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=None)
def _compiled_flex_sinks():
    """torch's flex_attention and the sinks' renormalisation in one compiled function, as a
    compiled model runs them."""
    raise_recompile_limits()
    return torch.compile(flex_attention_with_sinks, dynamic=False)


class CompileFailed(RuntimeError):
    """torch.compile could not compile a provider's call; the message says why, on one line."""


def is_compile_error(exc: BaseException) -> bool:
    """Whether an exception comes from torch.compile (Dynamo, AOTAutograd or Inductor), not from
    running the compiled code's kernels."""
    module = type(exc).__module__
    return module.startswith(("torch._dynamo", "torch._inductor", "torch._functorch"))


def compile_failure_text(exc: BaseException) -> str:
    """One line: the exception type, its first line and Dynamo's "Explanation:" line if any (the
    first line of Dynamo's errors is often a header such as "Observed exception")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    explanation = next((line for line in lines if line.startswith("Explanation:")), None)
    if explanation:
        text += f" ({explanation[len('Explanation:'):].strip()})"
    return text[:400]


# ---- FlashAttention-4 (flash_attn.cute) support rules -----------------------------------------

#: The compute capabilities (major) FlashAttention-4's kernels are built for.
FA4_ARCHS = {9: "Hopper (sm_90)", 10: "Blackwell (sm_100)", 11: "Blackwell (sm_110)"}


def _flash_cute_error() -> str | None:
    """Why ``flash_attn.cute`` does not import here (one line), or None when it does."""
    try:
        importlib.import_module("flash_attn.cute")
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def fa4_versions() -> str:
    """The installed FlashAttention-4 and CuTe DSL versions, e.g. "flash-attn-4 4.0.0b36,
    nvidia-cutlass-dsl 4.8.1" (names whose metadata is absent are left out)."""
    from importlib import metadata

    found = []
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def fa4_arch_reason(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on this device, or None on a Hopper or Blackwell GPU."""
    if device.type != "cuda":
        return "FlashAttention-4 needs a CUDA GPU (Hopper or Blackwell)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FA4_ARCHS:
        return (f"FlashAttention-4 runs on Hopper (sm_90) and Blackwell (sm_100/sm_110) GPUs; "
                f"this GPU is sm_{major}{minor}")
    return None


def cuda_major(device: torch.device) -> int | None:
    """The device's compute capability major (9 for Hopper), or None off CUDA."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


def fa4_input_reason(dtype: str, head_dim: int, v_head_dim: int, major: int | None) -> str | None:
    """Why FlashAttention-4 refuses inputs of this dtype and head dims on a GPU of this compute
    capability (major; None: no CUDA GPU), or None when it takes them.

    The rule is flash_attn.cute's own (it asserts it at the first call): 16-bit inputs, head dims a
    multiple of 8 (16-byte rows); up to 256 on Hopper; up to 128 on Blackwell, plus (192, 128),
    (256, 256) and the 512-wide value heads of its MLA kernels.
    """
    if major is None:
        return "FlashAttention-4 needs a CUDA GPU (Hopper or Blackwell)"
    if major not in FA4_ARCHS:
        return (f"FlashAttention-4 runs on Hopper (sm_90) and Blackwell (sm_100/sm_110) GPUs, not "
                f"compute capability {major}.x")
    if dtype not in ("bfloat16", "float16"):
        return f"FlashAttention-4 takes float16/bfloat16, not {dtype}"
    dims = (head_dim, v_head_dim)
    if head_dim % 8 or v_head_dim % 8:
        return f"FlashAttention-4 needs head dims that are multiples of 8, not (D, Dv)={dims}"
    if major == 9:
        if not (8 <= head_dim <= 256 and 8 <= v_head_dim <= 256):
            return f"FlashAttention-4 on Hopper takes head dims 8..256, not (D, Dv)={dims}"
        return None
    if (8 <= head_dim <= 128 and 8 <= v_head_dim <= 128) or dims in ((192, 128), (256, 256)) or (
            v_head_dim == 512 and head_dim in (64, 512)):
        return None
    return (f"FlashAttention-4 on Blackwell takes head dims 8..128, (192, 128), (256, 256) or "
            f"(64 or 512, 512), not (D, Dv)={dims}")


def flash_backend_refusal(exc: BaseException) -> str | None:
    """torch's reason when its FLASH backend refused a case while compiling (one line), or None
    when ``exc`` is another failure.

    torch raises "BACKEND='FLASH' but flash attention cannot be used: <reason>" or a
    NotImplementedError, which torch.compile wraps in its own exception types.
    """
    marker = "BACKEND='FLASH' but flash attention cannot be used"
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        text = str(link)
        if marker in text:
            return text[text.index(marker):].splitlines()[0]
        if isinstance(link, NotImplementedError):
            return f"NotImplementedError: {text.splitlines()[0] if text else ''}"
        link = link.__cause__ or link.__context__
    text = str(exc)
    if "NotImplementedError: " in text:
        return text[text.index("NotImplementedError: "):].splitlines()[0]
    return None


class TorchFlexProvider(Provider):
    name = "torch_flex"
    description = "torch.nn.attention.flex_attention under torch.compile (Triton backend)"
    kernel_options: dict | None = None

    def available(self, device):
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except Exception as exc:
            return False, f"torch {torch.__version__} has no flex_attention ({exc})"
        if device.type != "cuda":
            return False, ("torch's compiled flex_attention is a GPU baseline; compiling it for the "
                           "CPU takes minutes and is skipped here")
        return True, f"torch {torch.__version__} flex_attention, compiled"

    def prepare(self, ctx):
        from torch.nn.attention.flex_attention import create_block_mask

        refuse_fp8(ctx, "torch's flex_attention takes no float8 inputs (no descale arguments)")
        c = ctx.case
        bm = None
        if ctx.mods.mask_mod is not None:
            mb, mh = ctx.mask_dims()
            bm = create_block_mask(ctx.mods.mask_mod, mb if mb > 1 else None, mh if mh > 1 else None,
                                   c.q_len, c.kv_len, device=ctx.device,
                                   BLOCK_SIZE=ctx.settings.block_size)
        sinks = ctx.mods.sinks
        if sinks is None:
            compiled = _compiled_flex()
        else:
            with_sinks = _compiled_flex_sinks()

            def compiled(q, k, v, **kwargs):
                return with_sinks(q, k, v, sinks, **kwargs)
        score_mod, gqa = ctx.mods.score_mod, c.gqa
        # torch's default tiles can exceed shared memory for a mod with many live values (its
        # compile then fails with "out of resource"); retry as a user would, with the smaller
        # kernel_options below, and say so in the rows' note.
        fallbacks = [dict(self.kernel_options or {}, **extra)
                     for extra in ({}, {"num_stages": 2}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2})]
        prepared = Prepared(None, _block_mask_bytes(bm), "; ".join(filter(None, [
            "torch BlockMask" if bm is not None else "", TORCH_SINKS_NOTE if sinks is not None else ""])))

        def call(q, k, v):
            while True:
                opts = fallbacks[0] or None
                try:
                    return compiled(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                    kernel_options=opts)
                except Exception as exc:
                    text = str(exc).lower()
                    if ("out of resource" not in text and "hardware limit" not in text) or len(fallbacks) == 1:
                        raise
                    fallbacks.pop(0)
                    prepared.note = "; ".join(filter(None, [
                        prepared.note.split("; kernel_options")[0],
                        f"kernel_options={fallbacks[0]} (torch's default tiles ran out of shared memory)"]))

        prepared.call = call
        return prepared


class TorchFlexFlashProvider(TorchFlexProvider):
    """torch's compiled flex_attention with ``kernel_options={"BACKEND": "FLASH"}``: torch lowers the
    mods to CuTe DSL and runs FlashAttention-4's kernels. Cases torch's FLASH backend refuses (its
    own reason) or FlashAttention-4 cannot take (dtype, head dims) are "unsupported" rows."""

    name = "torch_flex_flash"
    description = "torch flex_attention with kernel_options BACKEND=FLASH (FlashAttention-4 via flash_attn.cute)"
    kernel_options = {"BACKEND": "FLASH"}

    def available(self, device):
        ok, why = super().available(device)
        if not ok:
            return ok, why
        reason = fa4_arch_reason(device)
        if reason is not None:
            return False, f"BACKEND=FLASH: {reason}"
        err = _flash_cute_error()
        if err is not None:
            return False, f"flash_attn.cute (FlashAttention-4) does not import: {err}"
        return True, f"torch flex_attention, compiled, BACKEND=FLASH ({fa4_versions()})"

    def prepare(self, ctx):
        c = ctx.case
        refuse_fp8(ctx, "torch's flex_attention takes no float8 inputs (no descale arguments)")
        reason = fa4_input_reason(c.dtype, c.head_dim, c.v_head_dim, cuda_major(ctx.device))
        if reason is not None:
            raise Unsupported(reason)
        prepared = super().prepare(ctx)
        prepared.note = "; ".join(filter(None, ["BACKEND=FLASH", prepared.note]))
        inner = prepared.call

        def call(q, k, v):
            try:
                return inner(q, k, v)
            except Exception as exc:
                refusal = flash_backend_refusal(exc)
                if refusal is None:
                    raise
                raise Unsupported(f"torch's FLASH backend refused the case: {refusal}") from None

        prepared.call = call
        return prepared


# ---- SDPA -------------------------------------------------------------------------------------


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


class SDPAProvider(Provider):
    """torch SDPA pinned to one backend; masks and additive score_mods become a dense mask/bias."""

    backend = "MATH"
    takes_mask = True

    def available(self, device):
        try:
            _sdpa_backend(self.backend)
        except (ImportError, AttributeError):
            return False, f"torch {torch.__version__} has no SDPA backend {self.backend}"
        if self.backend == "MATH":
            return True, "SDPA math (eager)"
        if device.type != "cuda":
            return False, f"SDPA {self.backend.lower()} needs a CUDA GPU"
        if self.backend == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
            return False, "cuDNN is not available"
        if self.backend == "FLASH_ATTENTION":
            check = getattr(torch.backends.cuda, "is_flash_attention_available", None)
            if check is not None and not check():
                return False, "this torch build has no flash attention kernels"
        return True, f"SDPA {self.backend.lower()}"

    def _express(self, ctx: CaseContext, *, grad: bool = False):
        """(attn_mask, is_causal, note) for the case, or raise Unsupported."""
        try:
            trivial = ctx.score_is_trivial()
            shape = ctx.mask_shape()
            if trivial and shape.kind == "none":
                return None, False, "no mask"
            if trivial and shape.kind == "causal" and shape.offset == 0:
                return None, True, "is_causal=True"
            if not self.takes_mask:
                raise Unsupported(f"SDPA {self.backend.lower()} takes no attn_mask, and the variant "
                                  "needs one (only no mask and top-left causal are expressible)")
            if trivial:
                mask = ctx.dense_mask()
                return mask, False, f"dense bool mask {tuple(mask.shape)}"
            bias = ctx.dense_bias()
            return bias, False, f"dense {str(ctx.dtype).replace('torch.', '')} bias {tuple(bias.shape)}"
        except dense.NotExpressible as exc:
            raise Unsupported(str(exc)) from None

    def prepare(self, ctx):
        refuse_fp8(ctx, f"SDPA {self.backend.lower()} takes no float8 inputs (no descale arguments)")
        refuse_sinks(ctx, f"SDPA {self.backend.lower()}")
        mask, is_causal, note = self._express(ctx)
        backend = _sdpa_backend(self.backend)
        gqa = ctx.case.gqa
        c = ctx.case
        grad_call = None
        targets = []
        learnable = ctx.learnable
        if learnable and ctx.needs_grad and not ctx.score_is_trivial():
            # Gradients reach the learnable captured tensors only through a bias built with autograd.
            def grad_call(q, k, v):
                bias = dense.dense_bias(ctx.mods.score_mod, ctx.mods.mask_mod, c.batch, c.q_heads,
                                        c.q_len, c.kv_len, ctx.device, ctx.dtype, ctx.budget_bytes(),
                                        grad=True)
                return _sdpa(q, k, v, bias, False, gqa, backend)

            mask = mask.detach().clone().requires_grad_(True)
            targets = [mask]
            note += "; the timed backward also computes d(bias)"

        repeat = False
        if gqa:
            # Some backends lack enable_gqa; repeating K/V inside the call still measures them.
            first = ctx.inputs[0]
            try:
                with torch.no_grad():
                    _sdpa(first.q, first.k, first.v, mask, is_causal, True, backend)
            except Unsupported:
                repeat = True
                note += "; GQA by repeating K/V inside the call (no enable_gqa in this backend)"
        group = c.q_heads // c.kv_heads

        def call(q, k, v):
            if repeat:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                return _sdpa(q, k, v, mask, is_causal, False, backend)
            return _sdpa(q, k, v, mask, is_causal, gqa, backend)

        return Prepared(call, _tensor_bytes(mask), note, grad_call, targets)


def _sdpa(q, k, v, mask, is_causal, gqa, backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    with sdpa_kernel([backend]):
        try:
            return sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
        except RuntimeError as exc:
            if "No available kernel" in str(exc):
                raise Unsupported(f"SDPA {backend.name.lower()} refused the case: "
                                  f"{str(exc).splitlines()[0]}") from None
            raise


def sdpa_reference(ctx: CaseContext, q, k, v, mods, grad: bool = False):
    """SDPA math on a slice (nb, nq, L, D) with the slice's mods made dense: the same-dtype baseline.

    Raises NotExpressible when no dense mask or bias can express the mods.
    """
    from torch.nn.attention import SDPBackend

    if mods.sinks is not None:
        raise dense.NotExpressible("SDPA math has no attention sinks")
    if ctx.fp8:
        raise dense.NotExpressible("the fp8 pass's same-dtype baseline is FP8 math (flexcore.reference "
                                   "on the quantized inputs), which SDPA math does not do")
    c = ctx.case
    nb, nq = q.shape[0], q.shape[1]
    trivial = ctx.score_is_trivial()
    if mods.score_mod is None or trivial:
        mask = None if mods.mask_mod is None else dense.dense_mask(
            mods.mask_mod, nb, nq, c.q_len, c.kv_len, ctx.device)
    else:
        mask = dense.dense_bias(mods.score_mod, mods.mask_mod, nb, nq, c.q_len, c.kv_len, ctx.device,
                                q.dtype, grad=grad)
    return _sdpa(q, k, v, mask, False, nq != k.shape[1], SDPBackend.MATH)


class SDPAMath(SDPAProvider):
    name, backend, description = "sdpa_math", "MATH", "SDPA math backend (eager reference kernels)"


class SDPAEfficient(SDPAProvider):
    name, backend, description = ("sdpa_efficient", "EFFICIENT_ATTENTION",
                                  "SDPA memory-efficient backend (xFormers kernels)")


class SDPAFlash(SDPAProvider):
    name, backend, description = "sdpa_flash", "FLASH_ATTENTION", "SDPA flash backend (FlashAttention-2)"
    takes_mask = False


class SDPACudnn(SDPAProvider):
    name, backend, description = "sdpa_cudnn", "CUDNN_ATTENTION", "SDPA cuDNN backend"


# ---- flash_attn package (FA2 / FA3) and FlashAttention-4 (flash_attn.cute) ---------------------


class FlashAttnProvider(Provider):
    """The flash_attn package: causal / sliding window (bottom-right aligned), softcap, ALiBi."""

    name = "flash_attn"
    title = "flash_attn"
    description = "flash_attn package (FA3 flash_attn_interface if present, else FA2 flash_attn)"
    modules = (("flash_attn_interface", "FA3"), ("flash_attn", "FA2"))
    score_mod_refusal = ("flash_attn expresses softcap and ALiBi (FA2, with causal) only; this "
                         "score_mod is neither")

    def _load(self):
        errors = []
        for module, label in self.modules:
            try:
                mod = importlib.import_module(module)
                return getattr(mod, "flash_attn_func"), label
            except Exception as exc:
                errors.append(f"{module}: {type(exc).__name__}: {exc}")
        raise ImportError("; ".join(errors))

    def available(self, device):
        if device.type != "cuda":
            return False, "flash_attn needs a CUDA GPU"
        try:
            _, label = self._load()
        except ImportError as exc:
            return False, f"not installed ({exc})"
        return True, label

    def arguments(self, ctx: CaseContext, label: str, major: int | None) -> tuple[dict, list[str]]:
        """(keyword arguments of ``flash_attn_func``, notes) expressing the case's variant on a GPU
        of compute capability ``major`` (None: no CUDA GPU), or raise :class:`Unsupported` with the
        reason."""
        c = ctx.case
        refuse_sinks(ctx, f"{self.title}'s flash_attn_func as this provider calls it")
        if c.dtype not in ("bfloat16", "float16"):
            raise Unsupported(f"{self.title} takes float16/bfloat16, not {c.dtype}")
        shape = ctx.mask_shape()
        bottom_right = c.kv_len - c.q_len
        kwargs: dict = {}
        notes = []
        if shape.kind in ("causal", "window"):
            if shape.offset != bottom_right:
                raise Unsupported(f"{self.title} aligns causal masks bottom-right; this mask is top-left "
                                  f"with Q_LEN={c.q_len} != KV_LEN={c.kv_len}")
            kwargs["causal"] = True
            notes.append("causal")
            if shape.kind == "window":
                kwargs["window_size"] = (shape.window - 1, 0)
                notes.append(f"window_size=({shape.window - 1}, 0)")
        elif shape.kind != "none":
            raise Unsupported(f"{self.title} expresses no mask, causal and causal sliding window only")
        if not ctx.score_is_trivial():
            cap = dense.softcap_value(ctx.mods.score_mod, c.batch, c.q_heads, c.q_len, c.kv_len,
                                      ctx.device)
            slopes = None if cap is not None or label != "FA2" else dense.alibi_slopes(
                ctx.mods.score_mod, shape, c.batch, c.q_heads, c.q_len, c.kv_len, ctx.device)
            if cap is not None:
                # flash_attn caps the scaled score, as flex's score_mod sees it.
                kwargs["softcap"] = cap
                notes.append(f"softcap={cap:g}")
            elif slopes is not None:
                # FA2 adds -slope·|i + KV_LEN - Q_LEN - j| to the scaled score; under the causal
                # mask that is the ALiBi bias the score_mod computes.
                kwargs["alibi_slopes"] = slopes.float()
                notes.append("alibi_slopes")
            else:
                raise Unsupported(self.score_mod_refusal)
        if ctx.learnable and ctx.needs_grad:
            raise Unsupported(f"{self.title} cannot return gradients of the variant's captured tensors")
        return kwargs, notes

    def prepare(self, ctx):
        fn, label = self._load()
        if ctx.fp8 and label != "FA3":
            refuse_fp8(ctx, f"{self.title} ({label}) takes float16/bfloat16 only; FlashAttention-3's "
                            f"flash_attn_func (flash_attn_interface) takes FP8 with descales")
        kwargs, notes = self.arguments(ctx, label, cuda_major(ctx.device))

        def run(q, k, v, **extra):
            out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs, **extra)
            if isinstance(out, tuple):
                out = out[0]
            return out.transpose(1, 2)

        if ctx.fp8:
            def call(q, k, v):  # FA3's FP8: q_descale etc. of shape (B, Hkv), as the context's
                x = ctx.fp8_inputs(q)
                return run(x.q, x.k, x.v, q_descale=x.descale_q, k_descale=x.descale_k,
                           v_descale=x.descale_v)

            notes.append("float8_e4m3fn with q/k/v_descale")
        else:
            call = run
        return Prepared(call, 0, f"{label}: " + (", ".join(notes) or "dense"))


class FlashAttn4Provider(FlashAttnProvider):
    """FlashAttention-4's dense kernels (``flash_attn.cute.flash_attn_func``) on the (B, S, H, D)
    layout: no mask, causal and causal sliding window (bottom-right aligned, ``window_size``),
    softcap, GQA. Other masks and score_mods need CuTe DSL mods: see ``torch_flex_flash``."""

    name = "flash4"
    title = "FlashAttention-4"
    description = "FlashAttention-4 dense kernels (flash_attn.cute.flash_attn_func)"
    modules = (("flash_attn.cute", "FA4"),)
    score_mod_refusal = ("FlashAttention-4's flash_attn_func expresses a softcap only (no ALiBi "
                         "slopes, no other score_mod); this score_mod is not a softcap")

    def available(self, device):
        reason = fa4_arch_reason(device)
        if reason is not None:
            return False, reason
        err = _flash_cute_error()
        if err is not None:
            return False, f"flash_attn.cute (FlashAttention-4) does not import: {err}"
        major = torch.cuda.get_device_capability(device)[0]
        return True, f"FA4 flash_attn.cute on {FA4_ARCHS[major]} ({fa4_versions()})"

    def arguments(self, ctx, label, major):
        c = ctx.case
        refuse_fp8(ctx, f"{self.title}'s flash_attn_func takes float16/bfloat16 only")
        refuse_sinks(ctx, f"{self.title}'s flash_attn_func as this provider calls it (no learnable_sink)")
        reason = fa4_input_reason(c.dtype, c.head_dim, c.v_head_dim, major)
        if reason is not None:
            raise Unsupported(reason)
        return super().arguments(ctx, label, major)


# ---- registry ---------------------------------------------------------------------------------

PROVIDERS: dict[str, Provider] = {p.name: p for p in (
    FlexlabProvider(), FlexlabCompiledProvider(), FlexlabPagedProvider(), TorchFlexProvider(),
    TorchFlexFlashProvider(), SDPAMath(), SDPAEfficient(), SDPAFlash(), SDPACudnn(), FlashAttnProvider(),
    FlashAttn4Provider())}


def get(name: str) -> Provider:
    try:
        return PROVIDERS[name]
    except KeyError:
        raise KeyError(f"unknown provider {name!r}; known: {', '.join(PROVIDERS)}") from None


def availability(device: torch.device, names=None) -> dict[str, tuple[bool, str]]:
    """{provider: (available, reason)} on this machine."""
    out = {}
    for name in names or PROVIDERS:
        try:
            out[name] = get(name).available(device)
        except Exception as exc:  # a broken optional install must not stop the run
            out[name] = (False, f"availability check failed: {type(exc).__name__}: {exc}")
    return out

