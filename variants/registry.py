"""The gallery's registry: every variant by name, assembled from the family modules."""
from __future__ import annotations

from variants import basic, bias, blocks, decoding, documents, heads, scaling, vision, windows
from variants.core import UnknownVariantError, Variant, suggest

FAMILIES = (basic, windows, documents, blocks, vision, decoding, heads, bias, scaling)


def _build() -> dict[str, Variant]:
    registry: dict[str, Variant] = {}
    for family in FAMILIES:
        for variant in family.VARIANTS:
            if variant.name in registry:
                raise ValueError(f"two variants named {variant.name!r}")
            registry[variant.name] = variant
    return registry


REGISTRY: dict[str, Variant] = _build()


def names() -> list[str]:
    """Every variant name, in gallery order (masks, then score mods, then compositions)."""
    order = {"mask": 0, "score": 1, "both": 2}
    return sorted(REGISTRY, key=lambda n: (order[REGISTRY[n].kind], list(REGISTRY).index(n)))


def get(name: str) -> Variant:
    """The variant called ``name``.

    Raises:
        UnknownVariantError: with the close matches and the list of valid names.

    Example:
        >>> mods = variants.get("sliding_window").make(Q_LEN=4096, window_size=512)
    """
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownVariantError(
            f"unknown variant {name!r}.{suggest(str(name), list(REGISTRY))} "
            f"Valid names: {', '.join(names())}") from None
