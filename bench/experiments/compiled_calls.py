"""How fast is a compiled call against torch flex compiled, at training shapes, and what did the
launch policy's inline rules change?

Wall time per call of a synced loop (host and GPU overlapped, unpinned, the way a training loop runs),
median of interleaved rounds, causal + ALiBi bf16, forward (no grad) and forward+backward, for: torch
flex_attention compiled; flexcore compiled with the default policy; flexcore compiled with its own
ops only (launch.inline and inline_backward "off": the host-side dispatch the inline ops replace);
flexcore eager. Also the largest output difference to torch's. Needs a CUDA GPU.
docs/decisions.md#compiled-host-path records what it found. Host-bound rows move with the host's
state between processes: compare columns of one run only.

Usage: PYTHONPATH=. python3 bench/experiments/compiled_calls.py [BxHxSxD ...]
  default shapes 1x8x1024x64 2x16x512x64 4x8x1024x128 4x16x2048x128 8x8x2048x64
"""
import statistics
import sys
import time

import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

from flexcore import create_block_mask, flex_attention
from flexcore.kernels.policy import DispatchPolicy

SHAPES = [(1, 8, 1024, 64), (2, 16, 512, 64), (4, 8, 1024, 128), (4, 16, 2048, 128), (8, 8, 2048, 64)]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def timed(fns: dict, n: int = 30, rounds: int = 7) -> dict:
    for f in fns.values():
        for _ in range(4):
            f()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            start = time.perf_counter()
            for _ in range(n):
                f()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / n * 1e6)
    return {name: statistics.median(x) for name, x in samples.items()}


def run(B: int, H: int, S: int, D: int) -> None:
    torch._dynamo.reset()
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    slopes = torch.rand(H, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    block_mask = create_block_mask(causal, None, None, S, S, device="cuda")
    torch_mask = torch_block_mask(causal, None, None, S, S, device="cuda")
    ops_only = {"policy": DispatchPolicy().replace(launch={"inline": "off", "inline_backward": "off"})}
    fns = {
        "torch compiled": torch.compile(lambda q, k, v: torch_flex(q, k, v, score_mod=alibi, block_mask=torch_mask),
                                        fullgraph=True),
        "flexcore compiled": torch.compile(
            lambda q, k, v: flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask), fullgraph=True),
        "flexcore compiled, ops only": torch.compile(
            lambda q, k, v: flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask, kernel_options=ops_only),
            fullgraph=True),
        "flexcore eager": lambda q, k, v: flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask),
    }
    reference = fns["torch compiled"](q, k, v).float()
    diffs = {name: (f(q, k, v).float() - reference).abs().max().item() for name, f in fns.items()}

    def forward(f):
        def call():
            with torch.no_grad():
                f(q, k, v)
        return call

    def forward_backward(f):
        def call():
            f(q, k, v).backward(grad_out)
        return call

    for label, wrap in (("fwd", forward), ("fwd+bwd", forward_backward)):
        times = timed({name: wrap(f) for name, f in fns.items()})
        base = times["torch compiled"]
        print(f"{(B, H, S, D)} {label}: " + "; ".join(f"{name} {t:.0f} us ({base / t:.2f}x)"
                                                    for name, t in times.items()), flush=True)
    print("   max |out - torch's|: " + ", ".join(f"{name} {d:.3g}" for name, d in diffs.items()), flush=True)


def main(argv: list[str]) -> None:
    torch._dynamo.config.cache_size_limit = 64
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for shape in [tuple(map(int, a.split("x"))) for a in argv] or SHAPES:
        run(*shape)


if __name__ == "__main__":
    main(sys.argv[1:])
