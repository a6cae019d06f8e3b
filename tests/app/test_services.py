"""The workbench's glue below the pages: long masks drawn in bounded memory; every gallery
variant previews and opens in the Playground."""
from __future__ import annotations

import numpy as np
import torch
import pytest

pytest.importorskip("streamlit")  # skipped where streamlit is not installed

from app import sandbox, services  # noqa: E402

SHAPE = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 64, "KV_LEN": 64, "D": 16, "device": "cpu"}


@pytest.fixture(scope="module", autouse=True)
def _stop_checker():
    yield
    sandbox.shutdown()


def test_long_masks_are_pooled_in_slabs_with_exact_counts(monkeypatch):
    # 1000 x 700 pools by (4, 3) to at most 256 pixels a side; slabs of 1000 positions force many
    # slabs, and both ragged edges.
    monkeypatch.setattr(services, "_CHUNK_POSITIONS", 1000)
    L, S = 1000, 700
    rng = np.random.default_rng(0)
    offset = int(rng.integers(-50, 50))

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    view = services._mask_pooled(mask_mod, 0, 0, L, S)
    dense = np.arange(L)[:, None] + offset >= np.arange(S)[None, :]
    assert view["kept"] == int(dense.sum()) == sum(max(0, min(q + offset + 1, S)) for q in range(L))
    assert view["pool"] == (4, 3)
    expected, _ = services._pool(dense.astype(np.float64))
    np.testing.assert_allclose(view["frac"], expected, atol=1e-6)


def _variant_names() -> list[str]:
    try:
        import variants
    except ImportError:
        return []
    return variants.names()


@pytest.mark.parametrize("name", _variant_names())
def test_every_gallery_variant_previews_and_opens(name):
    import variants

    v = variants.get(name)
    view = services.gallery_view(name, tuple(sorted(v.defaults().items())), 96, 2, 1, 32)
    L, S = view["Q_LEN"], view["KV_LEN"]
    assert 0 <= view["mask"]["kept"] <= L * S == view["mask"]["total"]
    blocks = view["blocks"]
    q_blocks, kv_blocks = -(-L // 32), -(-S // 32)
    assert blocks["full"] + blocks["partial"] + blocks["empty"] >= q_blocks * kv_blocks
    # "Open in Playground" gives code the Playground's checker accepts at the Playground's shape.
    shape = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 64, "KV_LEN": v.default_kv_len(64), "D": 16,
             "dtype": "float32", "BLOCK_SIZE": 16}
    source = services.variant_source(name, v.defaults(), shape)
    result = sandbox.check_code(source, services.code_shape(shape), timeout_s=20)
    assert result["ok"], result


def test_code_creates_its_tensors_on_the_workbench_device():
    # In GPU mode a captured tensor written without device= must land on the GPU; "meta" stands
    # in for it here. A device the code names is kept.
    from app.usercode import run_code

    code = ("import torch\nbias = torch.zeros(H)\nhost = torch.zeros(2, device='cpu')\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n    return score + bias[h]\n")
    shape = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 8, "KV_LEN": 8, "D": 8, "device": "meta"}
    mods = run_code(code, shape)
    assert mods.tensors["bias"].device.type == "meta"
    assert mods.tensors["host"].device.type == "cpu"
    assert torch.empty(1).device.type == "cpu"  # the default is restored afterwards


def test_code_runs_in_an_importable_module():
    # torch.compile imports the module a function's __module__ names (the torch flex provider).
    import importlib

    from app.usercode import run_code

    code = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
    shape = {"B": 1, "Hq": 2, "Hkv": 2, "Q_LEN": 8, "KV_LEN": 8, "D": 8}
    mods = run_code(code, shape)
    module = importlib.import_module(mods.mask_mod.__module__)
    assert module.mask_mod is mods.mask_mod and module.Q_LEN == 8
