"""The forward matrix on a CUDA GPU, at S up to 8192 (run with `-m gpu` on the device)."""
from __future__ import annotations

import pytest
import torch

from tests.flexcore.cases import GPU_SHAPES, MOD_NAMES
from tests.flexcore.compare import seed_of
from tests.flexcore.test_attention import check_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mod_name", MOD_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_forward_gpu(shape, mod_name, dtype):
    if dtype == torch.float32 and shape.L * shape.S > 2048 * 2048:
        pytest.skip("fp32 covered at the smaller shapes; the fp64 reference dominates the run time")
    # Autotuning compiles every candidate config; one shape keeps it on, the rest use the first
    # candidate so the matrix compiles in minutes.
    options = None if shape.name == "gpu_1k" else {"autotune": False}
    check_forward(shape, mod_name, dtype, seed=seed_of(mod_name, shape.name, str(dtype)),
                  kernel_options=options, device="cuda")
