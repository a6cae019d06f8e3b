"""Shared fixtures of the bench tests: user mod files and one small SDPA-only run."""
from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """results.json of a small SDPA-math run (a few seconds)."""
    from bench import runner

    out = tmp_path_factory.mktemp("small_run")
    return runner.run(small_grid(), out, progress=False, log=lambda msg: None)
