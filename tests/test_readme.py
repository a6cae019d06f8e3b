"""The README's Python example runs as written (on the CPU here, on the GPU with -m gpu too), and
its output matches the float64 reference."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Appended to the example: its `out` against the float64 reference on the same inputs.
CHECK = """
from flexcore.reference import flex_attention_reference
from flexcore.testing import tolerance_check
golden = flex_attention_reference(q, k, v, score_mod=alibi, block_mask=bm)
baseline = flex_attention_reference(q, k, v, score_mod=alibi, block_mask=bm, upcast=False)
result = tolerance_check(out, golden, baseline)
print("CHECK", out.shape == q.shape, result.passed, result.describe())
"""


def api_example() -> str:
    """The first python block of the README's "Using flexcore from Python" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Using flexcore from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's API section has no python block"
    return match.group(1)


def test_the_readme_api_example_runs_as_written_and_matches_float64(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(api_example() + CHECK)
    # A fresh interpreter, as a reader would run it: the interpreter choice is flexcore's own.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BlockMask(" in done.stdout and "BlockCounts(" in done.stdout, done.stdout
    check = next(line for line in done.stdout.splitlines() if line.startswith("CHECK"))
    assert check.startswith("CHECK True True"), check
