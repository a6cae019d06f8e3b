"""What do the Gluon kernels for Hopper compile to: registers, stack (spills) and the SASS
instructions of the main loop, per kernel? Answered without a GPU.

Compiles, for sm_90a with triton's bundled ptxas, the dense Gluon forward in bf16 and in FP8 and the
Gluon backward's dK/dV and dQ kernels (dense and causal), D=128, from the host code's own launches
(flexcore.kernels.hopper builds the descriptors and constexprs over CPU tensors; a stand-in driver
reports an sm_90 target and the launch compiles instead of running). Prints each kernel's
registers and stack, then a histogram of the instructions between the longest loop's label and
its backward branch. Compare runs of this script with each other only (no GPU, no alignment hints
from real allocations). docs/decisions.md#fp8-forward used it to find the FP8 forward's byte
shuffles (PRMT, LOP3, SHFL).

It drives flexcore's internals (hopper.forward, hopper.BackwardLaunches, launch.run) and triton's
driver and JIT warmup; when those move, update the stand-ins below.

Usage: PYTHONPATH=. python3 bench/experiments/gluon_sass.py [forward|backward]
  e.g. git show REV:flexcore/kernels/templates/forward_hopper.py.tmpl > /tmp/old.tmpl
       FLEXLAB_GLUON_FORWARD_TEMPLATE=/tmp/old.tmpl python3 bench/experiments/gluon_sass.py forward
"""
import collections
import os
import re
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import flexcore._runtime as runtime  # noqa: E402

runtime.use_interpreter.cache_clear()
runtime.use_interpreter = lambda: False
runtime.prepare_triton = lambda: None
import flexcore.kernels.codegen as codegen  # noqa: E402

codegen.prepare_triton = lambda: None
if os.environ.get("FLEXLAB_GLUON_FORWARD_TEMPLATE"):  # another version of the forward's template
    _read = codegen.read_template
    codegen.read_template = lambda name: (open(os.environ["FLEXLAB_GLUON_FORWARD_TEMPLATE"]).read()
                                          if name == "forward_hopper.py.tmpl" else _read(name))


class _Sm90Driver:
    """Triton's CUDA driver, answering as an sm_90 device without touching one."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaDriver
        self.inner = CudaDriver.__new__(CudaDriver)

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):
        return None

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, t):
        return t

    def __getattr__(self, name):
        return getattr(self.inner, name)


triton.runtime.driver.set_active(_Sm90Driver())

from flexcore import create_block_mask  # noqa: E402
from flexcore.fp8 import check_fp8_inputs, key_major  # noqa: E402
from flexcore.kernels import hopper, launch  # noqa: E402
from flexcore.kernels.tables import BlockTensors  # noqa: E402
from flexcore.lowering import lower_mask_mod  # noqa: E402
from flexcore.masks import noop_mask  # noqa: E402

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OP = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", re.M)


def report(name, compiled):
    path = "/tmp/gluon_sass_" + re.sub(r"\W+", "_", name) + ".cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", path], capture_output=True,
                           text=True).stdout
    regs, stack = (re.findall(r"REG:(\d+).*?STACK:(\d+)", usage) or [("?", "?")])[0]
    sass = subprocess.run([os.path.join(TOOLS, "nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    labels = {m.group(1): int(m.group(2), 16)
              for m in re.finditer(r"^(\.L_x_\d+):\s*\n\s+/\*([0-9a-f]{4,})\*/", sass, re.M)}
    ops = [(int(m.group(1), 16), m.group(2)) for m in OP.finditer(sass)]
    loop = None
    for line in sass.splitlines():
        at = re.match(r"\s+/\*([0-9a-f]{4,})\*/", line)
        target = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", line)
        if at and target and labels.get(target.group(1), 1 << 40) < int(at.group(1), 16):
            span = (labels[target.group(1)], int(at.group(1), 16))
            if loop is None or span[1] - span[0] > loop[1] - loop[0]:
                loop = span
    body = collections.Counter(op for addr, op in ops if loop and loop[0] <= addr <= loop[1])
    print(f"{name}: {regs} registers, {stack} bytes of stack; longest loop {sum(body.values())} "
          f"instructions: {dict(body.most_common(14))}")


compiled = []


def compile_instead(kernel, grid, args, kwargs, policy=None):
    compiled.append(kernel.warmup(*args, grid=grid, **kwargs))


launch.run = compile_instead
B, H, L, D = 1, 2, 1024, 128
q, k, v, do = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(4))
which = sys.argv[1] if len(sys.argv) > 1 else "both"
if which in ("forward", "both"):
    hopper.forward(q, k, v, D ** -0.5)
    report("forward bf16", compiled[-1])
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    v8 = key_major(v8)
    one = torch.ones(1)
    hopper.forward(q8, k8, v8, D ** -0.5, descales=check_fp8_inputs(q8, k8, v8, one, one, one, device_check=False))
    report("forward fp8", compiled[-1])
if which in ("backward", "both"):
    stats = torch.zeros(B, H, L)
    for label, mask_mod in (("dense", None), ("causal", lambda b, h, qi, ki: qi >= ki)):
        bm = create_block_mask(mask_mod or noop_mask, B, H, L, L, device="cpu", BLOCK_SIZE=128)
        kv = BlockTensors.broadcast(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    (128, 128))
        qt = BlockTensors.broadcast(bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices,
                                    (128, 128))
        module = hopper.backward_module(lower_mask_mod(mask_mod or noop_mask))
        _, kernels = hopper.BackwardLaunches(module, kv, qt, mask_mod is None, D ** -0.5).prepare(
            q, k, v, do, stats, stats, ())
        for kind, (kernel, grid, args, kwargs) in zip(("dK/dV", "dQ"), kernels):
            compile_instead(kernel, grid, args, kwargs)
            report(f"backward {label} {kind}", compiled[-1])
