"""The Gallery's work: the registered variants, their previews (drawn by the worker) and their
source at the Playground's shape."""
from __future__ import annotations

import streamlit as st
import variants

from app.services.common import call, limits


def variant_catalog() -> list[dict]:
    """Every registered variant: name, title, kind, description and reference."""
    out = []
    for n in variants.names():
        v = variants.get(n)
        out.append({"name": n, "title": v.title, "kind": v.kind, "description": v.description,
                    "reference": str(v.reference.title), "link": v.reference.link})
    return out


def variant(name: str) -> variants.Variant:
    return variants.get(name)


@st.cache_data(show_spinner=False, max_entries=64)
def gallery_view(name: str, params_key: tuple, q_len: int, heads: int, h: int,
                 block_size: int) -> dict:
    """Mask, block map and (score mods) bias heatmap of a variant for head ``h``, from the worker."""
    return call("gallery_view", name=name, params=dict(params_key), q_len=q_len, heads=heads, h=h,
                block_size=block_size)


def variant_source(name: str, params: dict, shape: dict) -> str:
    """The variant's standalone snippet at the Playground's shape (for "Open in Playground")."""
    return variant(name).source(B=shape["B"], H=shape["Hq"], Q_LEN=shape["Q_LEN"],
                                KV_LEN=shape["KV_LEN"], device=limits().device, **params)
