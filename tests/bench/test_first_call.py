"""``python -m bench first-call``: a new mod's first result, timed in fresh processes."""
from __future__ import annotations

import json

from bench import first_call
from bench.__main__ import main


def test_first_call_times_each_variant_in_a_fresh_process(tmp_path, capsys):
    out = tmp_path / "fc"
    args = ["first-call", "--variants", "causal,alibi", "--providers", "flexlab", "--batch", "1",
            "--heads", "2", "--seq", "128", "--head-dim", "16", "--dtype", "fp32", "--device", "cpu",
            "--out", str(out)]
    assert main(args) == 0
    data = json.loads((out / "results.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["process", "causal", "alibi"]
    for name in ("causal", "alibi"):
        r = rows[name]
        assert r["provider"] == "flexlab" and r["status"] == "ok"
        assert r["first_s"] > 0 and r["mask_s"] >= 0 and r["second_ms"] > 0
        assert abs(r["total_s"] - r["first_s"] - r["mask_s"]) < 1e-9
    assert rows["process"]["first_s"] > 0
    summary = (out / "summary.md").read_text()
    assert "| causal |" in summary and "B=1, H=2, S=128, D=16, float32" in summary
    assert data["meta"]["command"] == "python -m bench " + " ".join(args)
    assert "flexlab first call s" in capsys.readouterr().out

    # An existing result is not overwritten without --force.
    before = (out / "results.json").read_text()
    assert main(args) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "results.json").read_text() == before


def test_first_call_reports_worker_failures_and_skips(tmp_path, capsys):
    assert main(["first-call", "--variants", "no_such_variant", "--providers", "flexlab",
                 "--seq", "64", "--batch", "1", "--heads", "1", "--head-dim", "16", "--device", "cpu"]) == 2
    assert "no_such_variant" in capsys.readouterr().err
    assert main(["first-call", "--providers", "nope", "--device", "cpu"]) == 2
    rows = first_call.measure(["torch_flex"], ["causal"], first_call.Shape(1, 1, 64, 16, "float32"), "cpu")
    assert rows == [{"provider": "torch_flex", "variant": "-", "status": "skipped", "note": rows[0]["note"]}]
    assert "GPU baseline" in rows[0]["note"]
    assert "torch_flex: skipped" in first_call.table(rows)


def test_first_call_rejects_bad_shapes_dtypes_and_devices(capsys, monkeypatch):
    import pytest
    import torch

    for flag, value in (("--seq", "0"), ("--batch", "-2"), ("--head-dim", "x")):
        with pytest.raises(SystemExit) as exc:
            main(["first-call", flag, value, "--device", "cpu"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and "not a positive integer" in err
    assert main(["first-call", "--dtype", "int8", "--device", "cpu"]) == 2
    assert "dtype 'int8'" in capsys.readouterr().err
    assert main(["first-call", "--device", "tpu"]) == 2
    assert "--device 'tpu': expected cpu or cuda" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["first-call", "--device", "cuda"]) == 2
    assert "no CUDA GPU on this machine" in capsys.readouterr().err
