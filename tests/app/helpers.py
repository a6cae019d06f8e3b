"""What the workbench's page tests share: the entry script, tiny shapes, mods, and AppTest helpers."""
from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from app import editor, experiments, panels

ENTRY = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
# Small enough for Triton's interpreter: a few hundred inner-loop steps per kernel call. Hq=2 with
# Hkv=1 exercises grouped-query attention; 16-blocks give a 4 x 4 block map.
TINY = {"B": 1, "Hq": 2, "Hkv": 1, "Q_LEN": 64, "KV_LEN": 64, "D": 16, "dtype": "float32",
        "BLOCK_SIZE": 16}

CAUSAL = """\
def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
"""

LEARNABLE = """\
import torch

bias = torch.linspace(-1.0, 1.0, H).requires_grad_()


def score_mod(score, b, h, q_idx, kv_idx):
    return score + bias[h] * (q_idx - kv_idx) / Q_LEN


def mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
"""

# No seed in the code: the reference and every candidate must still read the same tensor.
UNSEEDED = """\
import torch

bias = torch.randn(H, requires_grad=True)


def score_mod(score, b, h, q_idx, kv_idx):
    return score + bias[h] * (q_idx - kv_idx) / Q_LEN
"""


def playground(code: str | None = None, shape: dict | None = None, plain: bool = False,
               exp: str | None = None) -> AppTest:
    at = AppTest.from_file(ENTRY, default_timeout=300)
    at.session_state[experiments.SHAPE_KEY] = dict(shape or TINY)
    if code is not None:
        at.session_state[editor.CODE_KEY] = code
    at.session_state[editor.PLAIN_KEY] = plain
    if exp is not None:
        at.query_params["exp"] = exp
    return at.run()


def texts(at: AppTest, kind: str) -> list[str]:
    return [e.value for e in getattr(at, kind)]


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def problem_text(at: AppTest) -> str:
    """Error boxes and the text shown under them (messages are shown as text, in code blocks)."""
    return "\n".join(texts(at, "error") + texts(at, "code"))


#: The Playground tab that holds each action's button (only the open tab is drawn).
TAB_OF = {"pg_check_btn": "Check", "pg_grad_btn": "Gradients", "pg_bench_btn": "Benchmark",
          "pg_sweep_btn": "Sweep", "pg_compare_btn": "Compare", "pg_export_btn": "Export"}


def open_tab(at: AppTest, name: str) -> AppTest:
    at.session_state[panels.TAB_KEY] = name
    at.run()
    no_exception(at)
    return at


def click(at: AppTest, key: str) -> AppTest:
    if key in TAB_OF and at.session_state[panels.TAB_KEY] != TAB_OF[key]:
        open_tab(at, TAB_OF[key])
    at.button(key=key).click().run()
    no_exception(at)
    return at


def chart_titles(at: AppTest) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def table(at: AppTest, column: str):
    return next(t.value for t in at.table if column in t.value.columns)
