"""Every variant of the registry on a CUDA GPU in half precision, at a longer odd length
(run with `-m gpu` on the device)."""
from __future__ import annotations

import pytest
import torch

import variants
from flexcore import flex_attention
from flexcore.reference import flex_attention_reference
from flexcore.testing import assert_close_to_reference
from tests.variants.helpers import case_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Not a multiple of the 128-wide blocks: the last block row and column are ragged.
Q_LEN = 1000


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("setting", ["default", "example"])
@pytest.mark.parametrize("name", variants.names())
def test_variant_forward_gpu(name, setting, dtype):
    variant = variants.get(name)
    params = case_params(name, setting)
    q_len = Q_LEN
    if name == "natten" and setting == "example":  # the example image has 11 x 12 = 132 pixels
        q_len = params["image_height"] * params["image_width"]
    mods = variant.make(B=2, H=4, Q_LEN=q_len, device="cuda", **params)
    shape = mods.shape
    generator = torch.Generator(device="cuda").manual_seed(len(name))

    def rand(length):
        return torch.randn(shape.B, shape.H, length, 64, generator=generator,
                           device="cuda").to(dtype)

    q, k, v = rand(shape.Q_LEN), rand(shape.KV_LEN), rand(shape.KV_LEN)
    block_mask = mods.create_block_mask(BLOCK_SIZE=128)
    out = flex_attention(q, k, v, score_mod=mods.score_mod, block_mask=block_mask,
                         kernel_options={"autotune": False})
    golden = flex_attention_reference(q, k, v, score_mod=mods.score_mod, block_mask=block_mask)
    baseline = flex_attention_reference(q, k, v, score_mod=mods.score_mod, block_mask=block_mask,
                                        upcast=False)
    assert out.dtype == dtype
    assert_close_to_reference(out, golden, baseline, name=f"{mods.name} {dtype}")
