"""Shared fixtures of the bench tests: one small SDPA-only run."""
from __future__ import annotations

import pytest

from tests.bench.helpers import small_grid


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """results.json of a small SDPA-math run (a few seconds)."""
    from bench import runner

    out = tmp_path_factory.mktemp("small_run")
    return runner.run(small_grid(), out, progress=False, log=lambda msg: None)
