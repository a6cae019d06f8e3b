"""Shared by the bench tests: the user mod files, a small CPU grid over them, and a provider whose
outputs or gradients are wrong on purpose."""
from __future__ import annotations

from pathlib import Path

import torch

from bench import providers as prov

MODS = Path(__file__).parent / "mods"
CAUSAL = str(MODS / "causal.py")
ALIBI = str(MODS / "alibi_learnable.py")
SOFTCAP = str(MODS / "softcap.py")


def small_grid(providers=("sdpa_math",), variants=None, passes=("fwd", "fwd_bwd"), **settings):
    """A CPU-quick grid over the test mod files (GQA 4/2, odd lengths)."""
    from bench.grid import build_grid

    config = {"groups": [{"variants": list(variants or [CAUSAL, f"{ALIBI}+{CAUSAL}"]),
                          # 40 and 72 are not block multiples; 4 query heads on 2 KV heads.
                          "shapes": [[2, 40, 72]], "heads": [[4, 2]], "head_dim": [16],
                          "dtype": ["float32"], "passes": list(passes)}],
              "providers": list(providers), "settings": {"cpu_reps": 2, **settings}}
    return build_grid(config, "small")


class PerturbedProvider(prov.Provider):
    """SDPA math, with the output or dq scaled: the checks must catch it."""

    def __init__(self, name, out_scale=1.0, dq_scale=1.0, detach_bias=False):
        self.name, self.out_scale, self.dq_scale, self.detach_bias = name, out_scale, dq_scale, detach_bias

    def available(self, device):
        return True, "test provider"

    def prepare(self, ctx):
        inner = prov.SDPAMath().prepare(ctx)
        out_scale, dq_scale = self.out_scale, self.dq_scale

        class ScaleGrad(torch.autograd.Function):
            @staticmethod
            def forward(_, q):
                return q.view_as(q)

            @staticmethod
            def backward(_, g):
                return g * dq_scale

        def call(q, k, v):
            return inner.call(ScaleGrad.apply(q), k, v) * out_scale

        grad_call = None if self.detach_bias else (
            lambda q, k, v: (inner.grad_call or inner.call)(ScaleGrad.apply(q), k, v) * out_scale)
        return prov.Prepared(call, 0, "perturbed", grad_call)
