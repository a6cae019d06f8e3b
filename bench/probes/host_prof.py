"""Host time of flexlab's forward+backward call on host-bound anchors rows (D=64, B=4, S=4096):
enqueue time per call, per-call host time percentiles, and a cProfile of 200 calls.
Usage: PYTHONPATH=. python3 bench/probes/host_prof.py"""
import cProfile
import gc
import io
import pstats
import time

import torch

from bench.mods import resolve
from flexcore import create_block_mask, flex_attention

B, H, S, D = 4, 16, 4096, 64
for spec in ("sliding_window(window_size=1024)", "document(num_documents=8)"):
    mods = resolve(spec, B=B, H=H, KV_HEADS=H, Q_LEN=S, KV_LEN=S, D=D, device="cuda")
    bm = create_block_mask(mods.mask_mod, B, None, S, S, device="cuda")
    sets = []
    for _ in range(2):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sets.append((q, k, v, torch.randn_like(q)))

    def step(i):
        q, k, v, do = sets[i % 2]
        out = flex_attention(q, k, v, block_mask=bm)
        return torch.autograd.grad(out, [q, k, v], do)

    for i in range(30):
        step(i)
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for i in range(n):
        step(i)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    host = []
    for i in range(n):
        a = time.perf_counter()
        step(i)
        host.append(time.perf_counter() - a)
    torch.cuda.synchronize()
    host.sort()
    print(f"{spec}: enqueue {1e3 * (t1 - t0) / n:.3f} ms/call, wall {1e3 * (t2 - t0) / n:.3f} ms/call; host per call "
          f"p20/p50/p80/p99 {1e3 * host[n // 5]:.3f}/{1e3 * host[n // 2]:.3f}/{1e3 * host[4 * n // 5]:.3f}/"
          f"{1e3 * host[int(n * .99)]:.3f} ms; gc counts {gc.get_count()}", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        step(i)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(16)
    print("\n".join(s.getvalue().splitlines()[:40]))
