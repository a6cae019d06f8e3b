"""Do the backward's warp-specialized loops give the same gradients every time?

dQ, dK and dV are written without atomics, so repeated backward passes of one call must agree bit for
bit; a difference means a race. This repeats a soft-capped backward without a mask (the dense path,
where the warp-specialized loops run) with the dK/dV programs specialized, the dQ programs, and
neither, and prints for each how many passes differed from the first, with the largest difference and
the number of differing elements per gradient. With both kinds specialized at once (refused by
BackwardPolicy since docs/decisions.md#backward-dense-path recorded the race) it patches the policy's
check out to reproduce it. bf16, B=4 H=16 S=2048 D=128. Needs a Hopper GPU.

Usage: PYTHONPATH=. python3 bench/experiments/warp_spec_race.py [REPEATS]
"""
import dataclasses
import sys

import torch

from flexcore import KernelOptions, flex_attention
from flexcore.kernels.policy import DispatchPolicy


def policy(**backward) -> DispatchPolicy:
    base = DispatchPolicy().replace(gluon={"backward": "off"})  # the Triton template's loops
    if backward.get("warp_spec_kinds") == ("dkdv", "dq"):  # refused by the policy: build it unchecked
        fields = dataclasses.replace(base.backward, dense="on", warp_spec="on")
        object.__setattr__(fields, "warp_spec_kinds", ("dkdv", "dq"))
        return dataclasses.replace(base, backward=fields)
    return base.replace(backward=backward)


def main(repeats: int) -> None:
    torch.manual_seed(0)
    B, H, S, D = 4, 16, 2048, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30 * torch.tanh(score / 30)

    print(torch.cuda.get_device_name(), torch.__version__)
    cases = {"both kinds": dict(warp_spec_kinds=("dkdv", "dq")),
             "dK/dV programs": dict(dense="on", warp_spec="on", warp_spec_kinds=("dkdv",)),
             "dQ programs": dict(dense="on", warp_spec="on", warp_spec_kinds=("dq",)),
             "none (dense loops)": dict(dense="on", warp_spec="off")}
    for label, fields in cases.items():
        opts = KernelOptions(policy=policy(**fields))
        first, differing = None, []
        for _ in range(repeats):
            out = flex_attention(q, k, v, score_mod=softcap, kernel_options=opts)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            if first is None:
                first = grads
                continue
            diff = [((a.float() - b.float()).abs().max().item(), int((a != b).sum())) for a, b in zip(grads, first)]
            if any(n for _, n in diff):
                differing.append(diff)
        worst = max(differing, key=lambda d: sum(n for _, n in d), default=None)
        print(f"{label}: {len(differing)} of {repeats - 1} passes differ from the first; "
              f"worst (max |diff|, elements) dq/dk/dv: {worst}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
