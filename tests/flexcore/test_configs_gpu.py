"""Every GPU tile configuration the autotuners may pick, each pinned and checked on its own.

Autotuning picks a configuration by timing, so a configuration that computes wrong results would
otherwise fail only in the runs where it happens to win (run with `-m gpu` on the device).
"""
from __future__ import annotations

import pytest
import torch

from flexcore.kernels.decode import _GPU_CONFIGS as DECODE_CONFIGS
from flexcore.kernels.forward import gpu_configs
from flexcore.kernels.policy import DEFAULT_POLICY
from tests.flexcore.cases import Shape
from tests.flexcore.compare import seed_of
from tests.flexcore.helpers import check_decode, check_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Ragged lengths and gathers from captured tensors (a table indexed by q - kv, document ids) are
# where tile-specific bugs show: masked loads at the edge and loads inside the pipelined loop.
FORWARD_CASES = [(d, dtype, cfg) for d in (64, 128, 256) for dtype in (torch.bfloat16, torch.float32)
                 for cfg in gpu_configs(d, torch.empty((), dtype=dtype).element_size())]


@pytest.mark.parametrize("head_dim,dtype,config", FORWARD_CASES, ids=str)
@pytest.mark.parametrize("mod_name", ["relative_table", "document", "alibi"])
def test_forward_config(head_dim, dtype, config, mod_name):
    block_m, block_n, warps, stages = config
    shape = Shape(f"cfg{head_dim}", B=1, Hq=4, Hkv=2, L=1000, S=1531, D=head_dim, Dv=head_dim, block=128)
    # Descriptors (TMA) at every size, as larger calls take them on Hopper; small calls' pointer
    # loads are what the other GPU tests run.
    options = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
               "policy": DEFAULT_POLICY.replace(forward={"tma_min_flops": 0})}
    check_forward(shape, mod_name, dtype, seed=seed_of(mod_name, config, head_dim),
                  kernel_options=options, device="cuda")


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=str)
@pytest.mark.parametrize("mod_name", ["relative_table", "sliding_window", "prefix_lm", "softcap"])
def test_decode_config(config, mod_name):
    block_n, warps, stages = config
    shape = Shape("cfg_decode", B=4, Hq=32, Hkv=8, L=1, S=20000, D=128, Dv=128, block=128)
    check_decode(shape, mod_name, torch.bfloat16, seed=seed_of(mod_name, config), device="cuda",
                 opts={"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages})


def test_autotuned_candidates_compile_concurrently_and_once(monkeypatch):
    """A new mod's first call compiles every candidate of the forward's autotuner in the compile
    threads, with the arguments the autotuner then launches: it finds each one compiled (one
    kernel per candidate in triton's cache, none compiled twice), and the result is right."""
    from concurrent.futures import ThreadPoolExecutor

    from flexcore import create_block_mask, flex_attention
    from flexcore.kernels import forward as F
    from flexcore.kernels import launch as L
    from tests.flexcore.compare import assert_matches_reference
    from tests.flexcore.policies import policy_options

    submitted = []

    class Spy(ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            submitted.append(fn)
            return super().submit(fn, *args, **kwargs)

    opts = policy_options(launch={"compile_threads": 4})
    monkeypatch.setattr(L, "_pool", Spy(4))
    before = set(F._autotuners)

    def score_mod(score, b, h, q_idx, kv_idx):  # a constant no other test uses: a new module
        return 29.375 * torch.tanh(score / 29.375)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    gen = torch.Generator(device="cuda").manual_seed(seed_of("concurrent-compile"))
    q, k, v = (torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    bm = create_block_mask(causal, 1, 1, 1024, 1024, device="cuda")
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True, kernel_options=opts)
    tuned = [t for key, t in F._autotuners.items() if key not in before and isinstance(t, L.Tuned)]
    assert len(tuned) == 1
    configs = tuned[0].tuner.configs
    assert len(configs) >= 2 and len(submitted) == len(configs)
    assert len(tuned[0].tuner.fn.device_caches[q.device.index or 0][0]) == len(configs)
    assert_matches_reference(q, k, v, score_mod, bm, out, lse, "concurrent-compile")
