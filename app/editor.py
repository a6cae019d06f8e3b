"""The Playground's code editor: Ace (syntax highlighting) when it loads, else a plain text area.

The code lives in ``st.session_state[CODE_KEY]``, so errors, reruns and page switches never lose
it, and tests can set it directly.
"""
from __future__ import annotations

import os

import streamlit as st

CODE_KEY = "playground_code"
_VERSION_KEY = "playground_editor_version"
_INITIAL_KEY = "playground_editor_initial"
_SEEN_KEY = "playground_editor_seen"
PLAIN_KEY = "playground_plain_editor"


def ace_available() -> bool:
    try:
        import streamlit_ace  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("FLEXLAB_PLAIN_EDITOR", "") != "1"


def ensure_code(default: str) -> str:
    """The current code, initialised to ``default`` on first use."""
    if CODE_KEY not in st.session_state:
        set_code(default)
    return st.session_state[CODE_KEY]


def set_code(code: str) -> None:
    """Replace the editor's contents (template, gallery); the editor widget restarts with it."""
    st.session_state[CODE_KEY] = code
    st.session_state[_INITIAL_KEY] = code
    st.session_state[_VERSION_KEY] = st.session_state.get(_VERSION_KEY, 0) + 1
    st.session_state.pop(_SEEN_KEY, None)


def code_editor(annotations: list[dict] | None = None, height: int = 420) -> str:
    """Draw the editor and return the current code.

    Args:
        annotations: Ace gutter markers, ``[{"row": 0-based line, "column": 0, "text": ..,
            "type": "error"}]`` (ignored by the plain editor).
    """
    version = st.session_state.get(_VERSION_KEY, 0)
    plain = st.session_state.get(PLAIN_KEY, False) or not ace_available()
    widget_key = f"playground_text_{version}" if plain else f"playground_ace_{version}"
    if widget_key not in st.session_state:
        # The widget is being created (first visit, back from another page, editor switched):
        # it starts from the latest code, not from the text it was last created with.
        st.session_state[_INITIAL_KEY] = st.session_state.get(CODE_KEY, "")
        st.session_state[_SEEN_KEY] = st.session_state[_INITIAL_KEY]
    initial = st.session_state[_INITIAL_KEY]
    if plain:
        value = st.text_area("Code", value=initial, height=height, key=widget_key,
                             label_visibility="collapsed")
    else:
        from streamlit_ace import st_ace

        # At Ace's default 14 px, Chromium clips underscores with DejaVu Sans Mono (the usual
        # Linux monospace font): q_idx reads "q idx". 15 px draws them. Long lines wrap rather
        # than run past the column's edge.
        value = st_ace(value=initial, language="python", theme="chrome", keybinding="vscode",
                       font_size=15, tab_size=4, min_lines=18, auto_update=True, show_gutter=True,
                       wrap=True,
                       annotations=annotations or [], key=widget_key)
    # Adopt the widget's value only when the user changed it, so code set through session_state
    # (tests, other pages) is never overwritten by a widget that has not seen it yet.
    if isinstance(value, str) and value != st.session_state.get(_SEEN_KEY, initial):
        st.session_state[CODE_KEY] = value
    if isinstance(value, str):
        st.session_state[_SEEN_KEY] = value
    return st.session_state[CODE_KEY]
