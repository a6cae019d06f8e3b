"""Run-to-run spread of the forward+backward rows at head dim 128 (bench/NOTES.md entry 38): in
each of several fresh processes, the forward autotuner's choice, the backward's layout choice and
the forward and forward+backward times (median of do_bench, L2 flushed by do_bench) for the
causal and prefix LM masks at B=4 S=4096. bf16, H=16.
Usage: PYTHONPATH=. python3 bench/probes/run_to_run.py [--processes=4]
"""
import subprocess
import sys

CHILD = r"""
import torch
from triton.testing import do_bench
from flexcore import create_block_mask, flex_attention
from flexcore.kernels import backward as bwd, forward as fwd

def causal(b, h, q, kv):
    return q >= kv

def prefix(b, h, q, kv):
    return (q >= kv) | (kv < 1024)

q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
go = torch.randn_like(q)
for name, mod in (("causal", causal), ("prefix", prefix)):
    bm = create_block_mask(mod, 4, None, 4096, 4096, device="cuda")
    step = lambda: torch.autograd.grad(flex_attention(q, k, v, block_mask=bm), (q, k, v), go)
    forward = lambda: flex_attention(q, k, v, block_mask=bm)
    for _ in range(3):
        step()
    t_f = do_bench(forward, warmup=25, rep=300, return_mode="median")
    t_fb = do_bench(step, warmup=25, rep=300, return_mode="median")
    picks = sorted({str(c) for t in fwd._autotuners.values() if hasattr(t, "chosen") for c in t.chosen.values()})
    print(f"{name}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms, forward configs {picks}, "
          f"backward one launch {list(bwd._layout_choice.values())}", flush=True)
"""

ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
for i in range(int(ARGS.get("processes", 4))):
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    print(f"process {i}:")
    print("\n".join("  " + line for line in out.stdout.strip().splitlines()) or out.stderr[-2000:])
