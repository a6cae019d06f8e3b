"""flexlab's gallery of attention variants: name -> Variant, each making score/mask mods.

Example:
    >>> import variants
    >>> variants.names()[:3]
    ['noop', 'causal', 'sliding_window']
    >>> mods = variants.get("sliding_window").make(Q_LEN=4096, window_size=256)
    >>> mods.mask_mod.__name__
    'sliding_window_256'
"""
from __future__ import annotations

from variants.core import (Mods, Param, Reference, Shape, UnknownVariantError, Variant,
                           VariantError)
from variants.registry import REGISTRY, get, names

__all__ = ["Variant", "Param", "Reference", "Mods", "Shape", "VariantError",
           "UnknownVariantError", "REGISTRY", "get", "names"]
