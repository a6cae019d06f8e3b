"""``python -m variants list|describe|show``: table contents, PNG output, error messages."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import variants
from variants.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def test_list_table_has_every_variant_with_sparsity(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["name", "kind", "sparsity@4096", "reference"]
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert list(rows) == variants.names()
    for name, line in rows.items():
        variant = variants.get(name)
        assert f" {variant.kind} " in line and variant.reference.short() in line
    # Spot values at S = 4096 with 128-blocks: dense, causal (496 of 1024 blocks empty), and a
    # 256-token causal window (931 of 1024 empty).
    assert "  0.0%" in rows["noop"] and " 48.4%" in rows["causal"]
    assert " 90.9%" in rows["sliding_window"]
    assert "28 variants" in lines[-1] or f"{len(rows)} variants" in lines[-1]


def test_show_writes_png_and_prints_block_counts(tmp_path, capsys):
    from PIL import Image

    out = tmp_path / "mask.png"
    assert main(["show", "sliding_window", "--window_size", "100", "--seq", "512",
                 "--plot-block-size", "64", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # 8 x 8 blocks of 64; offsets q - kv in [0, 100) touch the diagonal (8 blocks), the first
    # (7) and the second (6, offsets 65..191) sub-diagonals, none of them whole.
    assert "sliding_window_100" in printed
    assert "blocks: full=0 partial=21 empty=43" in printed
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > 400


def test_show_score_mod_variant_with_params(tmp_path, capsys):
    out = tmp_path / "alibi.png"
    assert main(["show", "t5_bias", "--seq", "200", "--bidirectional=false", "--num-buckets",
                 "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "t5_bias_16buckets" in printed and "full=4 partial=0 empty=0" in printed
    assert out.stat().st_size > 1000


@pytest.mark.parametrize("argv,fragments", [
    (["show", "slidingwindow", "--out", "x.png"],
     ["unknown variant 'slidingwindow'", "Did you mean 'sliding_window'", "Valid names:",
      "bigbird"]),
    (["show", "sliding_window", "--window", "3", "--out", "x.png"],
     ["unknown parameter 'window'", "window_size (int in [1, 1048576], default 256)"]),
    (["show", "sliding_window", "--window_size", "-3", "--out", "x.png"],
     ["'window_size' = -3 is invalid", "int in [1, 1048576]"]),
    (["show", "document", "--causal", "maybe", "--out", "x.png"],
     ["'causal' = 'maybe' is invalid", "bool (true/false)"]),
    (["show", "bigbird", "--window_blocks", "2", "--out", "x.png"],
     ["one of 1, 3, 5, 7, 9"]),
    (["describe", "kerpel"], ["Did you mean 'kerple'"]),
])
def test_errors_list_what_is_valid(argv, fragments, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err
    assert not (tmp_path / "x.png").exists()


def test_describe_prints_parameters(capsys):
    assert main(["describe", "streaming_llm"]) == 0
    out = capsys.readouterr().out
    assert "arXiv:2309.17453" in out and "--num_sinks" in out and "--window_size" in out


def test_module_entry_point(tmp_path):
    out = tmp_path / "natten.png"
    result = subprocess.run(
        [sys.executable, "-m", "variants", "show", "natten", "--seq", "144", "--image_height",
         "12", "--image_width", "12", "--kernel_size", "3", "--plot-block-size", "16", "--out",
         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "natten_12x12_k3" in result.stdout and out.exists()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["show", "causal", "--out", "{tmp}/mask.txt"], ["--out", "mask.txt", ".png, .svg, .pdf"]),
    (["show", "causal", "--out", "{tmp}/missing/mask.png"], ["folder", "missing", "does not exist"]),
    (["show", "causal", "--out", "{tmp}"], ["expected a file ending in"]),
    # 100000² positions would be an 80 GB mask: refused before anything is allocated.
    (["show", "causal", "--seq", "100000", "--out", "{tmp}/mask.png"], ["--seq 100000", "capped at 8192"]),
    (["show", "causal", "--kv-seq", "9000", "--out", "{tmp}/mask.png"], ["--kv-seq 9000", "capped"]),
    (["show", "causal", "--heads", "100000", "--out", "{tmp}/mask.png"], ["--heads 100000", "capped"]),
    (["show", "causal", "--seq", "0", "--out", "{tmp}/mask.png"], ["--seq 0", "positive"]),
    (["show", "causal", "--plot-block-size", "0", "--out", "{tmp}/mask.png"], ["--plot-block-size 0"]),
    (["show", "causal", "--block-size", "64", "--out", "{tmp}/mask.png"],
     ["no parameter 'block_size'", "--plot-block-size"]),
])
def test_show_refuses_bad_outputs_and_sizes_in_one_line(argv, words, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    for word in words:
        assert word in line, line
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("*.txt"))


def test_show_argparse_errors_are_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["show", "causal", "--seq", "abc", "--out", str(tmp_path / "m.png")])
    assert exc.value.code == 2
    assert "--seq" in _one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--block-size", "--block_size"])
def test_variant_parameters_keep_their_names_beside_the_plot_options(flag, tmp_path, capsys):
    out = tmp_path / "bigbird.svg"
    assert main(["show", "bigbird", flag, "32", "--seq", "256", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # The variant's block_size is 32 (its name says so); the plot keeps its default 128 blocks.
    assert "bigbird_32_" in printed and "BLOCK_SIZE=128" in printed and out.stat().st_size > 1000
    assert main(["show", "bigbird", flag, "32", "--seq", "256", "--plot-block-size", "64",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "bigbird_32_" in printed and "BLOCK_SIZE=64" in printed


# A per-batch mask, and one with per-head random blocks.
@pytest.mark.parametrize("name, params", [("prefix_lm", {}), ("bigbird", {"block_size": 16})])
def test_the_plotted_mask_is_that_of_the_chosen_batch_and_head(name, params):
    from flexcore import create_mask
    from variants.__main__ import plotted_mask

    mods = variants.get(name).make(B=2, H=2, Q_LEN=256, **params)
    full = create_mask(mods.mask_mod, 2, 2, 256, 256, device="cpu")
    assert not all(torch.equal(full[0, 0], full[b, h]) for b in (0, 1) for h in (0, 1))
    for b in (0, 1):
        for h in (0, 1):
            assert torch.equal(plotted_mask(mods, b, h), full[b, h]), (name, b, h)
