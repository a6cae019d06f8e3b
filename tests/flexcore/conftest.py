"""Shared setup of flexcore's tests."""
import pytest

from flexcore.kernels import launch


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test starts without per-call plans: many tests patch flexcore's decisions (tiles,
    paths, launch spies), and a plan kept by an earlier test for the same mask (block_mask=None
    shares one) would skip them."""
    launch.clear_plans()
    yield
    launch.clear_plans()
