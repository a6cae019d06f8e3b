"""How accurate is the gradient of a learnable captured tensor (a per-head ALiBi slope) in bf16,
with and without the backward's delta pass, and what does the pass cost?

Accuracy: relative Frobenius error of dq, dk and dslope against the float64 reference, for
flexcore with the pass on and off, torch's compiled flex_attention, and torch's eager bf16 (the
reference without upcast); B=2 H=4 S=1024, causal, slopes of both signs, D=128 and 64.
Time: forward+backward with the learnable slope, pass on and off, best of two alternating rounds
of do_bench medians, B=4 H=16 S=4096. Needs a CUDA GPU. torch's compiled flex_attention is not
timed: with a learnable captured tensor its loop took about 950 ms per call at that size, which is
not a kernel time.

It switches the pass with the dispatch policy's backward.exact_delta, passed in kernel_options.

Usage: PYTHONPATH=. python3 bench/experiments/captured_grad_accuracy.py
See docs/decisions.md#exact-delta.
"""
import torch
from torch.nn.attention import flex_attention as torch_flex_mod
from triton.testing import do_bench

from flexcore import KernelOptions, create_block_mask, flex_attention
from flexcore.kernels.policy import DispatchPolicy
from flexcore.reference import flex_attention_reference

torch_flex = torch.compile(torch_flex_mod.flex_attention, dynamic=False)


def causal(b, h, q, kv):
    return q >= kv


def pass_options(exact: bool) -> KernelOptions:
    """Kernel options with the backward's delta pass on or off."""
    return KernelOptions(policy=DispatchPolicy().replace(backward={"exact_delta": exact}))


def alibi_of(slope):
    def alibi(score, b, h, q, kv):
        return score - slope[h] * (q - kv).abs()
    return alibi


def rel(a, g):
    return ((a.double() - g).norm() / g.norm()).item()


def accuracy(B, H, S, D, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, go = (torch.randn(B, H, S, D, device="cuda", generator=gen).bfloat16() for _ in range(4))
    slope0 = (torch.rand(H, device="cuda", generator=gen) * 0.2 - 0.1)  # both signs
    bm = create_block_mask(causal, B, None, S, S, device="cuda")
    tbm = torch_flex_mod.create_block_mask(causal, B, None, S, S, device="cuda")
    q64, k64, v64, s64 = (t.double().requires_grad_() for t in (q, k, v, slope0))
    gold = torch.autograd.grad(flex_attention_reference(q64, k64, v64, score_mod=alibi_of(s64), block_mask=bm,
                                                        upcast=True), (q64, k64, s64), go.double())
    rows = {}

    def grads(fn):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        slope = slope0.clone().requires_grad_()
        out = fn(*ins, alibi_of(slope))
        dq, dk, ds = torch.autograd.grad(out, (ins[0], ins[1], slope), go)
        return [rel(a, g) for a, g in zip((dq, dk, ds), gold)]

    for exact in (True, False):
        opts = pass_options(exact)
        rows[f"flexcore pass {'on' if exact else 'off'}"] = grads(
            lambda q, k, v, mod: flex_attention(q, k, v, score_mod=mod, block_mask=bm, kernel_options=opts))
    rows["torch flex compiled"] = grads(lambda q, k, v, mod: torch_flex(q, k, v, score_mod=mod, block_mask=tbm))
    rows["torch eager bf16"] = grads(lambda q, k, v, mod: flex_attention_reference(
        q, k, v, score_mod=mod, block_mask=bm, upcast=False))
    print(f"accuracy B={B} H={H} S={S} D={D} seed={seed}: relative error dq / dk / dslope")
    for name, errs in rows.items():
        print(f"  {name:22s} " + " / ".join(f"{e:.2e}" for e in errs))


def timing(B, H, S, D):
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    slope = (torch.rand(H, device="cuda") * 0.1).requires_grad_()
    go = torch.randn_like(q)
    bm = create_block_mask(causal, B, None, S, S, device="cuda")
    mod = alibi_of(slope)

    def ours(opts):
        torch.autograd.grad(flex_attention(q, k, v, score_mod=mod, block_mask=bm, kernel_options=opts),
                            (q, k, v, slope), go)

    res = {}
    for exact in (True, False, True, False):
        opts = pass_options(exact)
        for _ in range(3):
            ours(opts)
        res.setdefault(exact, []).append(do_bench(lambda: ours(opts), warmup=25, rep=200, return_mode="median"))
    on, off = min(res[True]), min(res[False])
    print(f"time B={B} H={H} S={S} D={D} fwd+bwd ms: pass on {on:.3f}, off {off:.3f} "
          f"(+{(on / off - 1) * 100:.1f}%)")


if __name__ == "__main__":
    for seed in (0, 1):
        accuracy(2, 4, 1024, 128, seed)
    accuracy(2, 4, 1024, 64, 2)
    for D in (128, 64):
        timing(4, 16, 4096, D)
