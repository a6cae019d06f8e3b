"""File-name-safe names made from user text (experiment titles, run names)."""
from __future__ import annotations

import re


def file_safe(text: str, default: str, *, sep: str = "_", keep: str = "", limit: int | None = None) -> str:
    """``text`` with each run of characters other than ASCII letters, digits and those in ``keep``
    replaced by ``sep``, ``sep`` stripped from both ends and the rest cut to ``limit`` characters;
    ``default`` where nothing is left.

    Example: ``file_safe("my mod|v2", "x") == "my_mod_v2"``.
    """
    return re.sub(f"[^A-Za-z0-9{re.escape(keep)}]+", sep, text).strip(sep)[:limit] or default
