"""One transformer block's training step, compiled: forward+backward with each attention provider.

The block is pre-norm (``x + proj(attention(norm(x)))``, then ``x + mlp(norm(x))``) with the
case's variant mods in the attention, GQA projections and a GELU MLP. The case gives its shape:
``d_model = q_heads · head_dim``, the MLP is 4 · d_model wide. A step is the compiled block's
forward and the gradients of its input, its parameters and the variant's learnable captured
tensors for an upstream gradient ``g`` (the gradient of ``loss = Σ out · g``), as a training loop
computes them before the optimizer step.

Attention providers:

- ``flexlab``: ``flexcore.flex_attention`` called eagerly from the compiled block
  (``torch.compiler.disable``: one graph break around it), which works whatever torch.compile
  makes of flexcore;
- ``flexlab_compiled``: ``flexcore.flex_attention`` inside the block's graph, ``fullgraph=True``;
- ``torch_flex``: torch's ``flex_attention`` inside the block's graph, ``fullgraph=True``.

Outputs and gradients are checked against the same block in float64 with flexcore's float64
reference attention, with the runner's rule (max_abs ≤ 2 · the same-dtype eager block's + eps).

Example (CPU, tiny; the GPU preset is ``python -m bench run --config train-step``):
    >>> from bench.grid import build_grid
    >>> grid = build_grid({"providers": ["flexlab"], "settings": {"compile_backend": "aot_eager"},
    ...     "groups": [{"variants": ["causal"], "shapes": [[1, 64]], "heads": [2], "head_dim": [16],
    ...                 "dtype": ["float32"], "passes": ["train_step"]}]})
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench import providers as prov
from bench.context import make_context, rotation_sets
from bench.flops import attention_flops
from bench.runner import CaseRunner, _eps, _error_text, _metrics
from bench.timing import peak_memory, time_call, time_first_call
from flexcore.testing import within_tolerance

#: Providers a train-step case runs (other providers of the grid give it no rows).
TRAIN_PROVIDERS = ("flexlab", "flexlab_compiled", "torch_flex")
MLP_RATIO = 4


class Block(nn.Module):
    """A pre-norm transformer block whose attention is a function ``attention(q, k, v) -> out``
    on (B, H, S, D) tensors.

    Args:
        d_model: width of the residual stream.
        q_heads, kv_heads, head_dim: attention heads (GQA when kv_heads < q_heads).
        attention: the attention call, holding the variant's mods and masks.
        norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm).
    """

    def __init__(self, d_model: int, q_heads: int, kv_heads: int, head_dim: int, attention,
                 norm: str = "rms", device=None, dtype=None):
        super().__init__()
        if norm not in ("rms", "layer"):
            raise ValueError(f"norm={norm!r}: expected 'rms' or 'layer'")
        kw = {"device": device, "dtype": dtype}
        make_norm = nn.RMSNorm if norm == "rms" else nn.LayerNorm
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.norm1 = make_norm(d_model, eps=1e-6, **kw)
        self.qkv = nn.Linear(d_model, (q_heads + 2 * kv_heads) * head_dim, bias=False, **kw)
        self.proj = nn.Linear(q_heads * head_dim, d_model, bias=False, **kw)
        self.norm2 = make_norm(d_model, eps=1e-6, **kw)
        self.up = nn.Linear(d_model, MLP_RATIO * d_model, bias=False, **kw)
        self.down = nn.Linear(MLP_RATIO * d_model, d_model, bias=False, **kw)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        hq, hkv, d = self.q_heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = q.view(B, S, hq, d).transpose(1, 2)
        k = k.view(B, S, hkv, d).transpose(1, 2)
        v = v.view(B, S, hkv, d).transpose(1, 2)
        a = self.attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, hq * d))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


def init_state(d_model: int, q_heads: int, kv_heads: int, head_dim: int, seed: int) -> dict:
    """Seeded float32 weights of a :class:`Block` (on the CPU): N(0, 1/fan_in) linears, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"qkv.weight": ((q_heads + 2 * kv_heads) * head_dim, d_model),
              "proj.weight": (d_model, q_heads * head_dim),
              "up.weight": (MLP_RATIO * d_model, d_model), "down.weight": (d_model, MLP_RATIO * d_model)}
    state = {name: torch.randn(*shape, generator=gen) / math.sqrt(shape[1]) for name, shape in shapes.items()}
    state.update({"norm1.weight": torch.ones(d_model), "norm2.weight": torch.ones(d_model)})
    return state


def block_flops(batch: int, q_heads: int, kv_heads: int, seq: int, head_dim: int, density: float) -> float:
    """Useful FLOPs of one training step of the block: the projections and the MLP (forward 2·m·n·k
    per matmul, backward twice that) plus the attention's forward+backward
    (:func:`bench.flops.attention_flops`)."""
    d_model = q_heads * head_dim
    per_token = 2 * d_model * ((q_heads + 2 * kv_heads) * head_dim + q_heads * head_dim
                               + 2 * MLP_RATIO * d_model)
    return 3.0 * batch * seq * per_token + attention_flops(batch, q_heads, seq, seq, head_dim, head_dim,
                                                           density, "fwd_bwd")


class TrainStepRunner(CaseRunner):
    """Runs one ``train_step`` case over the providers of :data:`TRAIN_PROVIDERS` and returns its
    rows (same schema as :class:`bench.runner.CaseRunner`'s)."""

    def run(self):
        c, s = self.case, self.grid.settings
        names = [n for n in self.grid.providers if n in TRAIN_PROVIDERS]
        try:
            self.ctx = make_context(c, s, self.device, n_sets=0, mods=self.case_mods())
            self.density = self.ctx.density()
            self.coverage = "all"
            self._inputs()
        except Exception as exc:
            for name in names:
                self.row(name, "status", None, status="error", note=f"case setup failed: {_error_text(exc)}")
            self._cleanup()
            return self.rows
        try:
            self._golden_and_baseline()
            for name in names:
                self._provider(name)
        finally:
            self._cleanup()
        return self.rows

    # ---- inputs, weights, references ----
    def _inputs(self):
        c, s = self.case, self.grid.settings
        self.d_model = c.q_heads * c.head_dim
        self.state = init_state(self.d_model, c.q_heads, c.kv_heads, c.head_dim, s.seed)
        gen_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        gen = torch.Generator(device=gen_device).manual_seed(s.seed + 1)
        dtype = c.torch_dtype()
        n_sets = rotation_sets(2 * c.batch * c.q_len * self.d_model * dtype.itemsize, self.device)
        self.inputs = []
        for _ in range(n_sets):
            x, g = (torch.randn(c.batch, c.q_len, self.d_model, generator=gen, device=gen_device)
                    .to(self.device, dtype) for _ in range(2))
            self.inputs.append((x.requires_grad_(True), g))

    def _block(self, attention, dtype) -> Block:
        c = self.case
        block = Block(self.d_model, c.q_heads, c.kv_heads, c.head_dim, attention, device=self.device,
                      dtype=dtype)
        block.load_state_dict({k: v.to(self.device, dtype) for k, v in self.state.items()})
        return block

    def _targets(self, block: Block, x: torch.Tensor) -> list[torch.Tensor]:
        return [x, *block.parameters(), *self.ctx.learnable]

    def _reference_attention(self, upcast: bool):
        from flexcore.reference import flex_attention_reference

        mods, bm, gqa = self.ctx.mods, self.ctx.flex_block_mask(), self.case.gqa

        def attention(q, k, v):
            return flex_attention_reference(q, k, v, score_mod=mods.score_mod, block_mask=bm,
                                            enable_gqa=gqa, upcast=upcast, sinks=mods.sinks)

        return attention

    def _grads(self, block: Block, x: torch.Tensor, g: torch.Tensor, call=None):
        """(out, [dx, d(parameters)..., d(learnable captured)...]) of one step, eagerly or through ``call``."""
        out = (call if call is not None else block)(x)
        grads = torch.autograd.grad(out, self._targets(block, x), g.to(out.dtype), allow_unused=True)
        return out, grads

    def _split(self, block: Block, grads) -> dict:
        n_params = len(list(block.parameters()))
        parts = {"dx": [grads[0]], "dparams": list(grads[1:1 + n_params])}
        for (name, t), grad in zip(self.ctx.learnable_named, grads[1 + n_params:]):
            parts[f"d{name}"] = [grad if grad is not None else torch.zeros_like(t)]
        return parts

    def _golden_and_baseline(self):
        x, g = self.inputs[0]
        self.baseline = None
        try:
            golden_block = self._block(self._reference_attention(upcast=True), torch.float64)
            out, grads = self._grads(golden_block, x.detach().double().requires_grad_(True), g.double())
            self.golden = {"out": [out.detach()], **{k: [t.detach().double() for t in v]
                                                     for k, v in self._split(golden_block, grads).items()}}
        except Exception as exc:
            self.row("baseline", "status", None, status="error", note=f"float64 block failed: {_error_text(exc)}")
            return
        try:
            base_block = self._block(self._reference_attention(upcast=False), x.dtype)
            out, grads = self._grads(base_block, x, g)
            parts = {"out": [out.detach()], **self._split(base_block, grads)}
        except Exception as exc:
            self.row("baseline", "status", None, status="error",
                     note=f"same-dtype eager block failed: {_error_text(exc)}")
            return
        errors = {}
        note = "eager block, flexcore.reference(upcast=False) attention"
        for key, golden in self.golden.items():
            errors[key] = _metrics(parts[key], golden)
            for metric in ("max_abs", "mean_abs", "rel_fro"):
                self.row("baseline", f"{key}_{metric}", errors[key][metric],
                         "rel" if metric == "rel_fro" else "abs", note=note)
        self.baseline = errors

    # ---- one provider ----
    def _attention(self, name: str):
        """(attention call, fullgraph, note) of a train-step provider."""
        ctx, c = self.ctx, self.case
        score_mod, gqa, sinks = ctx.mods.score_mod, c.gqa, ctx.mods.sinks
        if name in ("flexlab", "flexlab_compiled"):
            from flexcore import flex_attention

            bm = ctx.flex_block_mask()

            def attention(q, k, v):
                return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                      sinks=sinks)

            if name == "flexlab":
                return (torch.compiler.disable(attention), False,
                        "flexcore called eagerly from the compiled block (one graph break)")
            return attention, True, "flexcore inside the block's graph (fullgraph=True)"
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        bm = None
        if ctx.mods.mask_mod is not None:
            mb, mh = ctx.mask_dims()
            bm = create_block_mask(ctx.mods.mask_mod, mb if mb > 1 else None, mh if mh > 1 else None,
                                   c.q_len, c.kv_len, device=self.device,
                                   BLOCK_SIZE=self.grid.settings.block_size)

        def attention(q, k, v):
            if sinks is None:
                return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)
            return prov.flex_attention_with_sinks(q, k, v, sinks, score_mod=score_mod,
                                                  block_mask=bm, enable_gqa=gqa)

        note = "torch flex_attention inside the block's graph (fullgraph=True)"
        return attention, True, note + (f"; {prov.TORCH_SINKS_NOTE}" if sinks is not None else "")

    def _run_provider(self, name: str):
        c, s = self.case, self.grid.settings
        ok, why = self.availability.get(name, (False, "unknown provider"))
        if not ok:
            self.row(name, "status", None, status="skipped", note=why)
            return
        try:
            start = time.perf_counter()
            attention, fullgraph, note = self._attention(name)
            block = self._block(attention, c.torch_dtype())
            # Dynamo caches compiled frames per code object, and every provider's block runs
            # Block.forward: without a reset a fullgraph compile could reuse another provider's
            # graph-broken frames and measure them.
            torch._dynamo.reset()
            prov.raise_recompile_limits()
            compiled = torch.compile(block, fullgraph=fullgraph, dynamic=False, backend=s.compile_backend)
            setup_s = time.perf_counter() - start
        except Exception as exc:
            self._error(name, "prepare", exc)
            return
        note = f"{note}; torch.compile(backend={s.compile_backend})"
        inputs = self.inputs

        def step(i):
            x, g = inputs[i]
            return self._grads(block, x, g, compiled)

        try:
            compile_s = time_first_call(lambda: step(0), self.device)
        except Exception as exc:
            if prov.is_compile_error(exc):
                exc = prov.CompileFailed(f"torch.compile(fullgraph={fullgraph}, backend={s.compile_backend}) "
                                         f"of the block failed: {prov.compile_failure_text(exc)}")
            self._error(name, "first call", exc)
            return
        self.row(name, "setup_s", setup_s, "s", note=note)
        self.row(name, "compile_s", compile_s, "s", note=note)
        memory = []
        self._check(name, block, step, memory)
        try:
            # On the CPU the correctness step (the same work) is measured instead of one more
            # step: steps under Triton's interpreter cost seconds.
            peak, method = memory[0] if memory else peak_memory(lambda: step(0), self.device)
            self.row(name, "peak_mem_bytes", peak, "bytes", note=method)
            timing = time_call(step, len(inputs), self.device, warmup_ms=s.warmup_ms, rep_ms=s.rep_ms,
                               min_reps=s.min_reps, max_reps=s.max_reps, cpu_reps=s.cpu_reps,
                               pin_host=s.pin_host)
        except Exception as exc:
            self._error(name, "timing", exc)
            return
        pinned = "" if timing.pinned_core is None else f", host threads on core {timing.pinned_core}"
        tnote = f"{timing.method}, {len(inputs)} rotated input set(s){pinned}"
        self.timing_rows(name, timing, tnote)
        seconds = timing.median_ms * 1e-3
        if seconds > 0:
            self.row(name, "tokens_per_s", c.batch * c.q_len / seconds, "tokens/s",
                     note="batch · sequence length / median step time")
            flops = block_flops(c.batch, c.q_heads, c.kv_heads, c.q_len, c.head_dim, self.density)
            self.row(name, "tflops", flops / seconds / 1e12, "TFLOP/s",
                     note=f"bench.train_step.block_flops, density {self.density:.4f}")

    def _check(self, name: str, block: Block, step, memory: list):
        """The loss and the errors of the first input set's step against the float64 block (on the
        CPU, the step's peak memory is appended to ``memory``)."""
        x, g = self.inputs[0]
        result = []
        try:
            if self.device.type == "cuda":
                result.append(step(0))
            else:
                memory.append(peak_memory(lambda: result.append(step(0)), self.device))
            out, grads = result[0]
        except Exception as exc:
            self._error(name, "correctness run", exc)
            return
        loss = float((out.detach().double() * g.double()).sum())
        self.row(name, "loss", loss, "", status="ok" if math.isfinite(loss) else "fail",
                 note="sum(out · g) of the first input set")
        if self.baseline is None:
            self.row(name, "out_correct", None, status="error",
                     note="no float64 golden or baseline for this case (see the baseline rows)")
            return
        parts = {"out": [out.detach()], **self._split(block, grads)}
        eps = _eps(x.dtype)
        for key, golden in self.golden.items():
            errors = _metrics(parts[key], golden)
            tol = 2.0 * self.baseline[key]["max_abs"] + eps
            passed = within_tolerance(errors["max_abs"], tol)
            for metric in ("max_abs", "mean_abs", "rel_fro"):
                self.row(name, f"{key}_{metric}", errors[metric], "rel" if metric == "rel_fro" else "abs")
            rule = f"max_abs <= 2 * baseline {self.baseline[key]['max_abs']:.3g} + {eps:g}"
            self.row(name, f"{key}_tolerance", tol, "abs", note=rule)
            self.row(name, f"{key}_correct", 1 if passed else 0, "bool", status="ok" if passed else "fail",
                     note=rule)

    def _cleanup(self):
        self.inputs = []
        super()._cleanup()
