"""Command-line entry points: presets, providers, grid flags, errors."""
from __future__ import annotations

import json

from bench.__main__ import _variants, main
from tests.bench.helpers import ALIBI, CAUSAL


def test_list_presets_and_providers(capsys):
    assert main(["list-presets"]) == 0
    out = capsys.readouterr().out
    assert "anchors" in out and "tiny" in out and "34 cases" in out
    assert "small" in out and "train-step" in out
    assert main(["list-providers", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "sdpa_math" in out and "torch_flex" in out and "skipped here" in out


def test_run_from_flags(tmp_path, capsys):
    out = tmp_path / "r"
    code = main(["run", "--variants", f"{CAUSAL},{ALIBI}", "--batch", "1", "--seq", "24", "--heads", "2",
                 "--head-dim", "8", "--dtype", "fp32", "--passes", "fwd", "--providers", "sdpa_math",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert {(r["variant"], r["q_len"], r["dtype"]) for r in data["rows"]} == {
        (CAUSAL, 24, "float32"), (ALIBI, 24, "float32")}


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["run", "--config", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "preset" in capsys.readouterr().err
    assert main(["run", "--config", "tiny", "--providers", "bogus", "--out", str(tmp_path / "y")]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["run", "--config", "tiny", "--passes", "fwd", "--dtype", "fp16", "--out",
                 str(tmp_path / "z")]) == 2
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "rep")]) == 2
    assert main(["run", "--config", "tiny", "--cuda-graphs", "decode,bwd", "--out",
                 str(tmp_path / "g")]) == 2
    assert "cuda_graphs='decode,bwd'" in capsys.readouterr().err


class _Stop(Exception):
    """Raised by a stand-in runner once it has seen the grid."""


def test_pin_host_flags_reach_the_settings(monkeypatch, tmp_path):
    """Unpinned unless --pin-host (the headline is what a training loop pays); the two flags
    exclude each other."""
    import pytest

    from bench import runner
    seen = {}

    def fake_run(grid, *a, **k):
        seen["settings"] = grid.settings
        raise _Stop

    monkeypatch.setattr(runner, "run", fake_run)
    for flags, pinned in (([], False), (["--no-pin-host"], False), (["--pin-host"], True)):
        seen.clear()
        with pytest.raises(_Stop):
            main(["run", "--config", "tiny", *flags, "--out", str(tmp_path / str(len(flags)) / str(pinned))])
        assert seen["settings"].pin_host is pinned, flags
    with pytest.raises(SystemExit):
        main(["run", "--config", "tiny", "--pin-host", "--no-pin-host", "--out", str(tmp_path / "x")])


def test_anchors_time_their_providers_in_interleaved_rounds():
    from bench.grid import PRESETS, Settings

    assert Settings().pin_host is False
    for name in ("anchors", "anchors-d64"):
        assert PRESETS[name]["settings"]["rounds"] == 3
        assert "pin_host" not in PRESETS[name]["settings"]  # the default: unpinned


def test_variant_list_splits_outside_parentheses():
    assert _variants("a(x=1,y=2)+b,c") == ["a(x=1,y=2)+b", "c"]


def test_forward_entry_is_the_anchors_forward_grid():
    from bench import forward

    grid = forward.build(forward.build_parser().parse_args([]))
    assert len(grid.cases) == 14 and {c.pass_ for c in grid.cases} == {"fwd"}
    assert grid.providers == ["flexlab", "torch_flex", "sdpa_flash", "sdpa_cudnn"]
    grid = forward.build(forward.build_parser().parse_args(["--decode", "--variants", "causal,noop"]))
    # --variants replaces the variants of every group, the decode rows included.
    assert {(c.variant, c.pass_) for c in grid.cases} == {(v, p) for v in ("causal", "noop") for p in ("fwd", "decode")}


def test_forward_entry_reports_bad_input_in_one_line(tmp_path, capsys):
    from bench import forward

    for flag, named in (("--variants", "unknown variant 'nosuch'"), ("--providers", "unknown provider(s) ['nosuch']")):
        assert forward.main([flag, "nosuch", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and named in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_processes_flag_runs_the_grid_in_several_processes(monkeypatch, tmp_path, capsys):
    import pytest

    from bench import runner, spread
    seen = {}

    def fake_run_processes(grid, out, processes, **kwargs):
        seen.update(grid=grid, out=out, processes=processes, **kwargs)
        raise _Stop

    def plain_run(*a, **k):
        raise AssertionError("a run of several processes must not run in this process")

    monkeypatch.setattr(spread, "run_processes", fake_run_processes)
    monkeypatch.setattr(runner, "run", plain_run)
    with pytest.raises(_Stop):
        main(["run", "--config", "tiny", "--processes", "3", "--device", "cpu", "--out", str(tmp_path / "s"),
              "--resume"])
    assert seen["processes"] == 3 and seen["out"] == tmp_path / "s" and seen["resume"] is True
    assert seen["device"].type == "cpu" and seen["grid"].name == "tiny"
    assert main(["run", "--config", "tiny", "--processes", "1", "--out", str(tmp_path / "one")]) == 2
    assert "--processes 1: expected an integer >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["run", "--config", "tiny", "--processes", "0", "--out", str(tmp_path / "zero")])
    assert exited.value.code == 2 and "'0' is not a positive integer" in capsys.readouterr().err
