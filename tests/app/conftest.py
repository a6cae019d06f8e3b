"""Fixtures of the workbench tests: results and experiments go to temporary folders; the worker
process stops when the tests end."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _folders(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXLAB_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("FLEXLAB_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture(scope="session", autouse=True)
def _stop_worker():
    yield
    from app import client

    client.shutdown()
