"""Every GPU tile configuration the autotuners may pick, each pinned and checked on its own.

Autotuning picks a configuration by timing, so a configuration that computes wrong results would
otherwise fail only in the runs where it happens to win (run with `-m gpu` on the device).
"""
from __future__ import annotations

import pytest
import torch

from flexcore.kernels.decode import _GPU_CONFIGS as DECODE_CONFIGS
from flexcore.kernels.forward import gpu_configs
from tests.flexcore.cases import Shape
from tests.flexcore.compare import seed_of
from tests.flexcore.test_attention import check_forward
from tests.flexcore.test_decode import check_decode

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
    options = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
    check_forward(shape, mod_name, dtype, seed=seed_of(mod_name, config, head_dim),
                  kernel_options=options, device="cuda")


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=str)
@pytest.mark.parametrize("mod_name", ["relative_table", "sliding_window", "prefix_lm", "softcap"])
def test_decode_config(config, mod_name):
    block_n, warps, stages = config
    shape = Shape("cfg_decode", B=4, Hq=32, Hkv=8, L=1, S=20000, D=128, Dv=128, block=128)
    check_decode(shape, mod_name, torch.bfloat16, seed=seed_of(mod_name, config), device="cuda",
                 opts={"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages})
