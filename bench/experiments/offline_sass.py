"""Do two versions of the backward template compile to the same GPU kernel, and with how many
registers and spills? Answered without a GPU.

Compiles flex_bwd_kernel (causal mask, identity score_mod, D=128, dK/dV 64x128 and dQ 128x128
tiles, 8 warps, 2 stages, pointer loads) for sm_90 with triton's bundled ptxas, from the template
file given, and prints a hash of its SASS and its resource usage (registers, stack, shared
memory). Two templates whose hashes agree give the same kernel. The pointer arguments carry no
alignment hints here, so registers and stack differ from a launch on the GPU; compare runs of this
script with each other only. Runs on a CPU-only machine (about 10 s).

It drives flexcore's internals (the backward's source builder and the template's constexpr names);
when the template gains or loses a constexpr, update `consts` below.

Usage: PYTHONPATH=. python3 bench/experiments/offline_sass.py TEMPLATE_PATH [PHASE]
  e.g. git show REV:flexcore/kernels/templates/backward.py.tmpl > /tmp/old.tmpl
       python3 bench/experiments/offline_sass.py /tmp/old.tmpl
       python3 bench/experiments/offline_sass.py flexcore/kernels/templates/backward.py.tmpl
See docs/decisions.md#machine-spread (the check that ruled out a code change).
"""
import hashlib
import importlib.util
import os
import re
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "0"
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import flexcore._runtime as R
R.use_interpreter.cache_clear()
R.use_interpreter = lambda: False
R.prepare_triton = lambda: None
import flexcore.kernels.codegen as C
C.prepare_triton = lambda: None
from flexcore.kernels import backward as B
from flexcore.lowering import lower_score_mod, lower_mask_mod
from flexcore.lowering.vjp import lower_score_mod_backward
tmpl = sys.argv[1]
phase = int(sys.argv[2]) if len(sys.argv) > 2 else 0
C.read_template = B.read_template = lambda name: open(tmpl).read()  # backward.py imported it by name
sl = lower_score_mod(None, torch.float32)
ml = lower_mask_mod(lambda b, h, q, k: q >= k)
sbl = lower_score_mod_backward(None, sl)
src = B.build_backward_source(sl, sbl, ml)
os.makedirs("/tmp/sass", exist_ok=True)
path = f"/tmp/sass/bwd_{os.getpid()}.py"
open(path, "w").write(src)
spec = importlib.util.spec_from_file_location("bwdmod", path)
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
k = m.flex_bwd_kernel
D = 128
consts = dict(PHASE=phase, GQA_GROUP=1, HEAD_DIM=D, HEAD_DIM_PAD=D, HEAD_DIM_V=D, HEAD_DIM_V_PAD=D,
    DKDV_BLOCK_M=64, DKDV_BLOCK_N=128, DQ_BLOCK_M=128, DQ_BLOCK_N=128, SPARSE_Q_BLOCK=128, SPARSE_KV_BLOCK=128,
    HAS_FULL_BLOCKS=True, EVEN_Q=True, EVEN_KV=True, SCORE_IS_TRIVIAL=True, WRITE_CAPTURED_GRADS=False,
    FIXED_POINT_GRADS=False, UPCAST_DOT=False, INPUT_PRECISION="ieee", USE_TMA=False,
    FULL_Q_RUNS=False, FULL_KV_RUNS=False, P_FROM_LSE=True, DENSE=False, DKDV_WARP_SPEC=False, DQ_WARP_SPEC=False)
# The accumulator's dtype: a flag since the inline backward, a tl.dtype in older templates.
consts.update(ACC_FP64=False) if "ACC_FP64" in k.arg_names else consts.update(ACC_DTYPE=tl.float32)
sig = {}
for name in k.arg_names:
    if name in consts: sig[name] = "constexpr"
    elif name in ("Q", "K", "V", "DO", "DQ", "DK", "DV"): sig[name] = "*bf16"
    elif name in ("ROW_STATS", "DELTA"): sig[name] = "*fp32"
    elif name.endswith("NUM_BLKS") or name.endswith("_IDX"): sig[name] = "*i32"
    elif name in ("SM_SCALE", "QK_SCALE_LOG2"): sig[name] = "fp32"
    else: sig[name] = "i32"
c = triton.compile(ASTSource(k, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=8, num_stages=2))
open("/tmp/sass/b.cubin", "wb").write(c.asm["cubin"])
sass = subprocess.run([os.path.dirname(triton.__file__) + "/backends/nvidia/bin/nvdisasm", "-c", "/tmp/sass/b.cubin"],
                      capture_output=True, text=True).stdout
body = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", l) for l in sass.splitlines() if "/*" in l)
print("sass lines", len(sass.splitlines()), "hash", hashlib.sha1(body.encode()).hexdigest()[:12])
print(subprocess.run([os.path.dirname(triton.__file__) + "/backends/nvidia/bin/cuobjdump", "--dump-resource-usage", "/tmp/sass/b.cubin"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
