"""Fixtures of the workbench tests: results go to a temporary folder; the code checker stops."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _results_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXLAB_RESULTS_DIR", str(tmp_path / "results"))


@pytest.fixture(scope="module", autouse=True)
def _stop_checker():
    yield
    from app import sandbox

    sandbox.shutdown()
