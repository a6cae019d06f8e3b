"""app.names.file_safe: the one sanitiser behind run labels (app.tasks.timing.label) and download
file names (app.ui.file_stem)."""
from __future__ import annotations

import pytest

from app.names import file_safe


@pytest.mark.parametrize("text,expected", [
    ("my mod|v2", "my_mod_v2"),        # "|" would split bench's case ids
    ("  --a.b--  ", "a_b"),
    ("élan", "lan"),                   # ASCII only: names must be portable file names
    ("!!!", "playground"),             # nothing left: the default
])
def test_run_labels(text, expected):
    assert file_safe(text, "playground") == expected


def test_limit_cuts_after_stripping():
    assert file_safe("_" + "a" * 50, "x", limit=40) == "a" * 40


def test_download_stems_keep_dots_and_dashes():
    assert file_safe("run 3: a.b_c-d", "experiment", sep="-", keep="._-") == "run-3-a.b_c-d"
    assert file_safe("???", "experiment", sep="-", keep="._-") == "experiment"
