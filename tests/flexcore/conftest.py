"""Shared setup of flexcore's tests."""
import pytest

from flexcore.kernels import backward as bwd
from flexcore.kernels import forward as fwd
from flexcore.kernels import launch


@pytest.fixture(scope="session", autouse=True)
def _session_plan_cache(tmp_path_factory):
    """Persisted kernel choices go to this session's folder: a choice remembered by an earlier run
    on the machine would skip the autotuning that GPU tests check."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLEXLAB_PLAN_CACHE", str(tmp_path_factory.mktemp("plans")))
        yield


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test starts without per-call plans: many tests patch flexcore's decisions (tiles,
    paths, launch spies), and a plan kept by an earlier test for the same mask (block_mask=None
    shares one) would skip them."""
    launch.clear_plans()
    yield
    launch.clear_plans()


@pytest.fixture
def decided(monkeypatch):
    """Counts of the forward's and the backward's full host paths (calls that ran no plan)."""
    counts = {"forward": 0, "backward": 0}

    def counting(name, real):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(fwd, "_forward", counting("forward", fwd._forward))
    monkeypatch.setattr(bwd, "_backward", counting("backward", bwd._backward))
    return counts


@pytest.fixture
def kernel_cache_dir(tmp_path_factory, monkeypatch):
    """Generated kernels go to one folder of this test session (FLEXLAB_CACHE_DIR), not the user's cache."""
    monkeypatch.setenv("FLEXLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kernels"))
