"""Compile flexcore's Triton backward kernel for sm_90 without a GPU and read its PTX/SASS.

Which score_mods make the backward spill, how many MUFU instructions and SASS instructions per loop
iteration does each take? Answered without a GPU.

Run from the repository root:  python3 bench/experiments/backward_sass.py [--only NAME_SUBSTRING]

Two stages, each in its own process:
  gen      (flexcore imported, interpreter on): lower the score_mods, write the filled backward
           template to gen/<mod>.py, and record the host's arguments and constexprs for a bf16
           causal call on an H100 (use_interpreter patched to False inside flexcore.kernels.backward
           so that _tiles / _template_args take their GPU branches) to gen/launches.json.
  compile  (no flexcore, TRITON_INTERPRET unset): import each generated file, specialize the
           recorded arguments exactly as triton's launcher does (its own binder), compile for
           GPUTarget("cuda", 90, 128), and count registers, spills, MUFU.TANH / MUFU.EX2 in the
           SASS and tanh.approx.f32 / ex2.approx in the PTX (whole kernel and inside loops).
Results: /tmp/flexlab_backward_sass/out/results.json, out/<config>.{ptx,sass,ttgir}, and a table on
stdout. It reaches into flexcore's internals (backward.template_choice, _template_args, _grad_buffers);
update stage_gen when they move. See docs/decisions.md#bf16-captured-rounding.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path("/tmp/flexlab_backward_sass")  # generated sources and compiler output, out of the tree
GEN = HERE / "gen"
OUT = HERE / "out"
H100_MAX_SHARED = 232448  # bytes of shared memory one block may opt into on sm_90

# (name, head dims) ; the mods themselves are built in stage_gen
MODS = ["none", "softcap", "alibi_f32", "alibi_f32_grad", "alibi_bf16", "alibi_bf16_grad"]
HEAD_DIMS = [64, 128]
B, H, SEQ = 2, 16, 4096


# --------------------------------------------------------------------------------------------
# stage 1: flexcore imported
# --------------------------------------------------------------------------------------------
def stage_gen():
    import torch

    import flexcore  # noqa: F401  (sets the interpreter up on this CPU-only machine)
    import flexcore.kernels.backward as bwd
    from flexcore.attention import kv_blocks as kv_blocks_of
    from flexcore.blockmask import create_block_mask
    from flexcore.kernels.forward import pad_head_dim
    from flexcore.kernels.tables import finer_tables, q_block_tensors
    from flexcore.lowering.api import lower_mask_mod, lower_score_mod
    from flexcore.lowering.vjp import lower_score_mod_backward
    from flexcore.options import KernelOptions

    GEN.mkdir(parents=True, exist_ok=True)
    # The generated sources import flexcore's helpers; stage 2 must not import flexcore (it would
    # switch the interpreter on), so the helpers file is copied beside them under another name.
    helpers = Path(bwd.__file__).parent.parent / "lowering" / "triton_helpers.py"
    (GEN / "fl_helpers.py").write_text(helpers.read_text())

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcap(score, b, h, q_idx, kv_idx):
        return 30 * torch.tanh(score / 30)

    def make_alibi(dtype, grad):
        slopes = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float32) * 8.0 / H).to(dtype)
        if grad:
            slopes.requires_grad_(True)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)
        return alibi

    mods = {"none": None, "softcap": softcap,
            "alibi_f32": make_alibi(torch.float32, False), "alibi_f32_grad": make_alibi(torch.float32, True),
            "alibi_bf16": make_alibi(torch.bfloat16, False), "alibi_bf16_grad": make_alibi(torch.bfloat16, True)}

    # The GPU branches of the host's decisions (tiles, INPUT_PRECISION, UPCAST_DOT).
    bwd.use_interpreter = lambda: False
    opts = KernelOptions()
    dt = torch.bfloat16
    bm = create_block_mask(causal, None, None, SEQ, SEQ, device="cpu")
    mask_lowered = lower_mask_mod(causal)
    launches = []
    for name, fn in mods.items():
        score_lowered = lower_score_mod(fn, torch.float32, fast_math=True)  # bf16 path: fast math
        score_bwd = lower_score_mod_backward(fn, score_lowered, torch.float32)
        src = bwd.build_backward_source(score_lowered, score_bwd, mask_lowered)
        src = src.replace("from flexcore.lowering.triton_helpers import *", "from fl_helpers import *")
        assert not re.search(r"^\s*(from|import)\s+flexcore", src, re.M), "flexcore import left"
        (GEN / f"bwd_{name}.py").write_text(src)
        for D in HEAD_DIMS:
            q = torch.empty(B, H, SEQ, D, dtype=dt)
            k, v, grad_out = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            kvb = kv_blocks_of(bm, B, H)
            qb = q_block_tensors(bm, B, H)
            fine = finer_tables(kvb, SEQ, mask_lowered, opts, lambda: False)
            choice = bwd.template_choice(q, k, v, grad_out, score_lowered, kvb, qb, opts, bool(score_bwd.grad_of))
            row_terms = torch.empty((2 if choice.p_from_lse else 1, B, H, SEQ), dtype=torch.float32)
            delta, row_stats = row_terms[0], row_terms[-1]
            _, grad_args = bwd._grad_buffers(score_lowered.captured, score_bwd.grad_of, opts.deterministic, "cpu")
            caps = (*score_lowered.kernel_args(), *mask_lowered.kernel_args())
            args, _, common = bwd._template_args(q, k, v, grad_out, dq, dk, dv, row_stats, delta, kvb, qb, 1 / D ** 0.5,
                                                 opts, score_lowered, caps, grad_args, choice)
            (bm1, bn1, meta1), (bm2, bn2, meta2) = choice.dkdv_tiles, choice.dq_tiles

            def enc(a):
                if isinstance(a, torch.Tensor):
                    return {"tensor": str(a.dtype).replace("torch.", ""), "ptr_mod16": a.data_ptr() % 16}
                if isinstance(a, bool) or not isinstance(a, (int, float)):
                    raise TypeError(f"unexpected argument {a!r}")
                return {"int": a} if isinstance(a, int) else {"float": a}

            enc_args = [enc(a) for a in args]
            phases = [(1, dict(PHASE=1, DKDV_BLOCK_M=bm1, DKDV_BLOCK_N=bn1, DQ_BLOCK_M=16, DQ_BLOCK_N=16), meta1),
                      (2, dict(PHASE=2, DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, DQ_BLOCK_M=bm2, DQ_BLOCK_N=bn2), meta2)]
            if choice.may_fuse:  # the host may time one launch (PHASE 0) against the two
                phases.append((0, dict(PHASE=0, DKDV_BLOCK_M=bm1, DKDV_BLOCK_N=bn1, DQ_BLOCK_M=bm2, DQ_BLOCK_N=bn2),
                               dict(meta1, num_stages=min(meta1["num_stages"], meta2["num_stages"]))))
            if choice.exact_delta:
                phases.append((3, dict(PHASE=3, DKDV_BLOCK_M=16, DKDV_BLOCK_N=16, DQ_BLOCK_M=bm2, DQ_BLOCK_N=bn2),
                               meta2))
            variants = [(phase, tiles, meta, "") for phase, tiles, meta in phases]
            if D == 128:  # the register-bound dK/dV tile: what fewer stages or a smaller BLOCK_M would give
                variants.append((1, dict(phases[0][1]), dict(meta1, num_stages=2), "_s2"))
                variants.append((1, dict(phases[0][1], DKDV_BLOCK_M=32), meta1, "_m32"))
            for phase, tiles, meta, variant in variants:
                launches.append(dict(mod=name, D=D, phase=phase, variant=variant, file=f"bwd_{name}.py", args=enc_args,
                                     constexprs={**common, **tiles}, meta=meta, may_fuse=choice.may_fuse,
                                     finer_tables_taken=fine is not None,
                                     head_dim_pad=pad_head_dim(D)))
    (GEN / "launches.json").write_text(json.dumps(launches, indent=1))
    print(f"gen: {len(launches)} launches, sources in {GEN}")


# --------------------------------------------------------------------------------------------
# stage 2: no flexcore
# --------------------------------------------------------------------------------------------
def _loop_spans(ptx_lines):
    """Index ranges [start, end] of PTX loop bodies: from a label to the last branch back to it."""
    labels = {}
    for i, line in enumerate(ptx_lines):
        m = re.match(r"^\s*(\$L__\w+):", line)
        if m:
            labels[m.group(1)] = i
    spans = []
    for i, line in enumerate(ptx_lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            spans.append((labels[m.group(1)], i))
    # keep outermost-free innermost view: drop spans that contain another span
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return sorted(set(inner))


def _sass_loops(sass_lines):
    """Per SASS loop (a backward branch and its target): instruction count, local-memory spills
    (STL/LDL), MUFU.TANH, MUFU.EX2 and HGMMA inside it. Innermost loops only."""
    insts = []
    for line in sass_lines:
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            insts.append((int(m.group(1), 16), m.group(2)))
    spans = []
    for addr, text in insts:
        m = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    spans = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    loops = []
    for lo, hi in sorted(set(spans)):
        body = [t for a, t in insts if lo <= a <= hi]
        loops.append(dict(instructions=len(body), stl=sum("STL" in t for t in body), ldl=sum("LDL" in t for t in body),
                          mufu_tanh=sum("MUFU.TANH" in t for t in body), mufu_ex2=sum("MUFU.EX2" in t for t in body),
                          hgmma=sum("HGMMA" in t for t in body)))
    return loops


def _count(pattern, lines):
    return sum(len(re.findall(pattern, l)) for l in lines)


def stage_compile(only: str | None):
    assert os.environ.get("TRITON_INTERPRET") != "1", "stage 2 must run without the interpreter"
    assert "flexcore" not in sys.modules
    import importlib.util

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    sys.path.insert(0, str(GEN))
    OUT.mkdir(parents=True, exist_ok=True)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    launches = json.loads((GEN / "launches.json").read_text())
    modules = {}
    results = []
    res_path = OUT / "results.json"
    if only and res_path.exists():
        results = [r for r in json.loads(res_path.read_text()) if only not in r["config"]]

    class AlignedMock(MockTensor):
        def __init__(self, dtype, ptr):
            super().__init__(dtype)
            self._ptr = ptr

        def data_ptr(self):
            return self._ptr

    for L in launches:
        config = f"{L['mod']}_D{L['D']}_P{L['phase']}{L.get('variant', '')}"
        if only and only not in config:
            continue
        mod = modules.get(L["file"])
        if mod is None:
            spec = importlib.util.spec_from_file_location(L["file"][:-3], GEN / L["file"])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            modules[L["file"]] = mod
        kernel = mod.flex_bwd_kernel
        args = []
        for a in L["args"]:
            if "tensor" in a:
                args.append(AlignedMock(getattr(torch, a["tensor"]), 4096 + a["ptr_mod16"]))
            else:
                args.append(a.get("int", a.get("float")))
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        kwargs = dict(L["constexprs"], **L["meta"])
        kwargs["debug"] = False
        kwargs["instrumentation_mode"] = ""
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        row = dict(config=config, mod=L["mod"], D=L["D"], phase=L["phase"], variant=L.get("variant", ""),
                   tiles={k: L["constexprs"][k] for k in ("DKDV_BLOCK_M", "DKDV_BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N")},
                   meta=L["meta"], may_fuse=L["may_fuse"], finer_tables_taken=L["finer_tables_taken"],
                   constexprs={k: v for k, v in L["constexprs"].items()})
        try:
            ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            results.append(row)
            print(config, "FAILED", row["error"], flush=True)
            continue
        ptx = ck.asm["ptx"]
        cubin = OUT / f"{config}.cubin"
        cubin.write_bytes(ck.asm["cubin"])
        (OUT / f"{config}.ptx").write_text(ptx)
        (OUT / f"{config}.ttgir").write_text(ck.asm["ttgir"])
        sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
        (OUT / f"{config}.sass").write_text(sass)
        res = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", res)
        regs, stack, shared_static, local = (int(x) for x in m.groups())
        ptx_lines = ptx.splitlines()
        spans = _loop_spans(ptx_lines)
        loops = []
        for s, e in spans:
            body = ptx_lines[s:e + 1]
            loops.append(dict(lines=e - s + 1,
                              tanh=_count(r"tanh\.approx\.f32", body),
                              ex2=_count(r"ex2\.approx", body),
                              mma=_count(r"wgmma\.mma_async|mma\.sync", body)))
        sass_lines = sass.splitlines()
        row.update(
            regs=regs, stack=stack, local=local, spill_stores=_count(r"\bSTL(?:\.\w+)*\b", sass_lines),
            spill_loads=_count(r"\bLDL(?:\.\w+)*\b", sass_lines),
            shared=ck.metadata.shared, fits_h100_shared=ck.metadata.shared <= H100_MAX_SHARED,
            num_warps=ck.metadata.num_warps, num_stages=ck.metadata.num_stages,
            sass_mufu_tanh=_count(r"MUFU\.TANH", sass_lines), sass_mufu_ex2=_count(r"MUFU\.EX2", sass_lines),
            sass_instructions=_count(r"^\s+/\*[0-9a-f]{4,}\*/", sass_lines),
            ptx_tanh=_count(r"tanh\.approx\.f32", ptx_lines), ptx_ex2=_count(r"ex2\.approx", ptx_lines),
            ptx_loops=loops, sass_loops=_sass_loops(sass_lines), resource_usage=res.strip().splitlines()[-1])
        results.append(row)
        print(f"{config}: regs {regs} stack {stack} local {local} shared {ck.metadata.shared} "
              f"MUFU.TANH {row['sass_mufu_tanh']} MUFU.EX2 {row['sass_mufu_ex2']} loops "
              f"{[(l['tanh'], l['ex2'], l['mma']) for l in loops]} sass loops {row['sass_loops']}", flush=True)
        res_path.write_text(json.dumps(results, indent=1))
    res_path.write_text(json.dumps(results, indent=1))
    table(results)


def table(results):
    """The markdown table of REPORT.md (also written to table.md)."""
    order = {1: 0, 2: 1, 3: 2, 0: 3}
    out = ["| mod | D | PHASE | tiles (M,N) | warps/stages | regs | spill: stack B (STL/LDL total) | shared B "
           "| MUFU.TANH | MUFU.EX2 | tanh.approx per loop (PTX) / score elements per thread "
           "| SASS insts per loop: partial / full (STL/LDL in loop) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (MODS.index(r["mod"]) if r["mod"] in MODS else 99, r["D"],
                                            order[r["phase"]], r.get("variant", ""))):
        t = r["tiles"]
        dkdv, dq = (t["DKDV_BLOCK_M"], t["DKDV_BLOCK_N"]), (t["DQ_BLOCK_M"], t["DQ_BLOCK_N"])
        ph = str(r["phase"]) + (" " + r["variant"].strip("_") if r.get("variant") else "")
        tiles = {0: f"{dkdv[0]}x{dkdv[1]} + {dq[0]}x{dq[1]}", 1: f"{dkdv[0]}x{dkdv[1]}"}.get(
            r["phase"], f"{dq[0]}x{dq[1]}")
        if "error" in r:
            out.append(f"| {r['mod']} | {r['D']} | {ph} | {tiles} | {r['meta']} | FAILED: {r['error'][:150]} |")
            continue
        threads = 32 * r["num_warps"]
        per_thread = {1: [dkdv[0] * dkdv[1] // threads] * 2,
                      0: [dkdv[0] * dkdv[1] // threads] * 2 + [dq[0] * dq[1] // threads] * 2}.get(
            r["phase"], [dq[0] * dq[1] // threads] * 2)
        tanh = ", ".join(f"{l['tanh']}/{e}" for l, e in zip(r["ptx_loops"], per_thread)) if r["ptx_tanh"] else "-"
        loops = " / ".join(f"{l['instructions']}" + (f" ({l['stl']}/{l['ldl']})" if l["stl"] or l["ldl"] else "")
                           for l in r["sass_loops"])
        spill = f"{r['stack']} ({r['spill_stores']}/{r['spill_loads']})" if r["stack"] else "0"
        out.append(f"| {r['mod']} | {r['D']} | {ph} | {tiles} | {r['num_warps']}/{r['num_stages']} | {r['regs']} "
                   f"| {spill} | {r['shared']} | {r['sass_mufu_tanh']} | {r['sass_mufu_ex2']} | {tanh} | {loops} |")
    text = "\n".join(out) + "\n"
    (HERE / "table.md").write_text(text)
    print(text)


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["gen"]:
        return stage_gen()
    if argv[:1] == ["compile"]:
        return stage_compile(argv[1] if len(argv) > 1 else None)
    if argv[:1] == ["table"]:
        return table(json.loads((OUT / "results.json").read_text()))
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    env = dict(os.environ)
    subprocess.run([sys.executable, __file__, "gen"], check=True, env=env)
    env.pop("TRITON_INTERPRET", None)
    subprocess.run([sys.executable, __file__, "compile"] + ([only] if only else []), check=True, env=env)


if __name__ == "__main__":
    main()
