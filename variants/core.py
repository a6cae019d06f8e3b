"""The gallery's data model: Variant, its typed Params, its Reference, and Mods, the one type of
score/mask mods with their captured tensors that the gallery, bench and the workbench share."""
from __future__ import annotations

import difflib
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch
from torch import Tensor

from flexcore import MaskMod, ScoreMod

Kind = Literal["mask", "score", "both"]
ParamType = Literal["int", "float", "bool", "choice"]

#: Names ``Variant.make`` / ``Variant.source`` take for the problem shape; no Param may use them.
SHAPE_NAMES = ("B", "H", "Q_LEN", "KV_LEN", "device")


class VariantError(ValueError):
    """A variant name, parameter value or bench variant spec that cannot be accepted."""


class UnknownVariantError(VariantError, KeyError):
    """No variant has the requested name."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def suggest(word: str, valid: list[str]) -> str:
    """' Did you mean X?' for the closest valid names, or ''."""
    close = difflib.get_close_matches(word, valid, n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


@dataclass(frozen=True)
class Reference:
    """Where a variant comes from: a paper (with its arXiv id) or a page."""

    title: str
    arxiv: str | None = None
    url: str | None = None

    @property
    def link(self) -> str:
        return f"https://arxiv.org/abs/{self.arxiv}" if self.arxiv else (self.url or "")

    def short(self) -> str:
        """``arXiv:2004.05150`` or the URL: what fits in a table column."""
        return f"arXiv:{self.arxiv}" if self.arxiv else (self.url or "")

    def __str__(self) -> str:
        return f"{self.title} ({self.short()})" if self.short() else self.title


@dataclass(frozen=True)
class Param:
    """One typed parameter of a variant: the app builds a slider, checkbox or select box from it.

    Args:
        name: keyword of ``Variant.make``; lowercase (upper-case names are the problem shape's).
        type: ``"int"``, ``"float"``, ``"bool"`` or ``"choice"``.
        default: value used when the caller gives none.
        help: one line shown next to the control.
        low, high: inclusive range for int and float parameters.
        choices: the valid values of a choice parameter.
    """

    name: str
    type: ParamType
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple = ()

    def __post_init__(self):
        if self.name in SHAPE_NAMES or not self.name.isidentifier():
            raise ValueError(f"Param name {self.name!r} is reserved or not an identifier")
        if self.type in ("int", "float") and (self.low is None or self.high is None):
            raise ValueError(f"Param {self.name!r}: numeric parameters need low and high")
        if self.type == "choice" and not self.choices:
            raise ValueError(f"Param {self.name!r}: choice parameters need choices")
        self.check(self.default, "(default)")

    def valid_text(self) -> str:
        """What values are valid, in words: ``int in [1, 4096]``."""
        if self.type == "int":
            return f"int in [{int(self.low)}, {int(self.high)}]"
        if self.type == "float":
            return f"float in [{self.low:g}, {self.high:g}]"
        if self.type == "bool":
            return "bool (true/false)"
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def check(self, value: Any, variant: str) -> Any:
        """Return ``value`` coerced to this parameter's type, or raise VariantError saying why."""
        bad = VariantError(f"{variant}: parameter {self.name!r} = {value!r} is invalid; "
                           f"expected {self.valid_text()} ({self.help})")
        if self.type == "bool":
            if isinstance(value, bool):
                return value
            raise bad
        if self.type == "choice":
            if value in self.choices:
                return value
            raise bad
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if self.type == "int":
            if isinstance(value, float) and not value.is_integer():
                raise bad
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise bad
        if not self.low <= value <= self.high:
            raise bad
        return value

    def parse(self, text: str, variant: str) -> Any:
        """Parse a command-line string, then check it."""
        try:
            if self.type == "int":
                value: Any = int(text)
            elif self.type == "float":
                value = float(text)
            elif self.type == "bool":
                lowered = text.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                value = lowered in ("true", "1", "yes")
            else:
                value = type(self.choices[0])(text)
        except ValueError:
            raise VariantError(f"{variant}: parameter {self.name!r} = {text!r} is invalid; "
                               f"expected {self.valid_text()} ({self.help})") from None
        return self.check(value, variant)


@dataclass(frozen=True)
class Shape:
    """The problem a variant's mods and captured tensors are built for."""

    B: int = 1
    H: int = 8
    Q_LEN: int = 1024
    KV_LEN: int = 1024
    device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class Mods:
    """A score_mod and/or a mask_mod with the tensors they read, and the problem they were built for.

    What a gallery variant makes, what a bench variant spec resolves to, and what the workbench's
    code defines; bench runs any of them (:func:`bench.runner.run_grid` takes them in memory).

    Attributes:
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, or None.
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``, or None.
        captured: the tensors the mods read, by name; those with ``requires_grad`` are learnable
            (bench and the workbench compare their gradients).
        shape: the problem the captured tensors were built for.
        batch_dependent, head_dependent: whether the mask differs across ``b`` / ``h``, so that
            a BlockMask needs that dimension (otherwise it broadcasts with ``None``).
        sinks: (H,) learnable attention-sink logits for ``flex_attention(..., sinks=)``, or None.
    """

    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    captured: Mapping[str, Tensor] = field(default_factory=dict)
    shape: Shape = Shape()
    batch_dependent: bool = False
    head_dependent: bool = False
    sinks: Tensor | None = None

    @property
    def name(self) -> str:
        """The mods' ``__name__`` values joined with ``+``."""
        return "+".join(getattr(m, "__name__", type(m).__name__)
                        for m in (self.mask_mod, self.score_mod) if m is not None)

    @property
    def learnable(self) -> dict[str, Tensor]:
        """The captured tensors with ``requires_grad``, by name: those gradients are taken of."""
        return {k: t for k, t in self.captured.items() if getattr(t, "requires_grad", False)}

    def block_mask_dims(self) -> tuple[int | None, int | None]:
        """``(B, H)`` to pass to ``create_block_mask``: None where the mask broadcasts."""
        return (self.shape.B if self.batch_dependent else None,
                self.shape.H if self.head_dependent else None)

    def create_block_mask(self, BLOCK_SIZE: int | tuple[int, int] = 128):
        """The BlockMask of ``mask_mod`` for this shape (every block full when there is no mask).

        Example:
            >>> mods = variants.get("sliding_window").make(Q_LEN=4096, window_size=256)
            >>> block_mask = mods.create_block_mask(BLOCK_SIZE=128)
        """
        from flexcore import create_block_mask, noop_mask

        B, H = self.block_mask_dims()
        return create_block_mask(self.mask_mod or noop_mask, B, H, self.shape.Q_LEN,
                                 self.shape.KV_LEN, device=self.shape.device, BLOCK_SIZE=BLOCK_SIZE)


Builder = Callable[..., Mods]


@dataclass(frozen=True)
class Variant:
    """One entry of the gallery.

    Attributes:
        name: registry key (``sliding_window``).
        title: human title.
        description: one paragraph: what it is and what it is for.
        reference: the paper (or page) that defines it.
        kind: ``"mask"``, ``"score"`` or ``"both"``: which mods ``make`` returns.
        params: typed parameters, each with a default, a range or choices, and a help line.
        build: ``build(shape, **params) -> Mods``; called by ``make`` with checked parameters.
        recipe: the body of ``source()``: Python that defines ``score_mod`` and/or ``mask_mod``
            using the helper functions, the problem shape (``B, H, Q_LEN, KV_LEN, device``) and
            ``{param}`` placeholders filled with ``repr(value)``; or a function of the
            parameters returning that text.
        helpers: functions whose source ``source()`` inlines before the recipe (in order), or a
            function of the parameters returning them.
        example: a non-default parameter setting, exercised by the tests and shown in docs.
        batch_dependent, head_dependent: whether the mask differs across batch / head.
        kv_len: ``kv_len(q_len, **params)``: the key length this variant is usually run with
            (cross-attention variants); None means ``q_len``.
    """

    name: str
    title: str
    description: str
    reference: Reference
    kind: Kind
    params: tuple[Param, ...]
    build: Builder
    recipe: str | Callable[..., str]
    helpers: tuple[Callable, ...] | Callable[..., tuple[Callable, ...]] = ()
    example: Mapping[str, Any] = field(default_factory=dict)
    batch_dependent: bool = False
    head_dependent: bool = False
    kv_len: Callable[..., int] | None = None

    def __post_init__(self):
        if self.kind not in ("mask", "score", "both"):
            raise ValueError(f"variant {self.name!r}: kind must be mask, score or both")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"variant {self.name!r}: duplicate parameter names {names}")

    @property
    def family(self) -> str:
        """The module that defines the variant, e.g. ``"windows"`` (for grouping in the app)."""
        return self.build.__module__.rsplit(".", 1)[-1]

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise VariantError(self._unknown_param_text(name))

    def _unknown_param_text(self, name: str) -> str:
        valid = "; ".join(f"{p.name} ({p.valid_text()}, default {p.default!r})"
                          for p in self.params)
        return (f"{self.name}: unknown parameter {name!r}.{suggest(name, self.param_names)} "
                f"Valid parameters: {valid or 'none'}")

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def resolve_params(self, **overrides: Any) -> dict[str, Any]:
        """All parameters: defaults updated with ``overrides``, each checked against its Param.

        Raises:
            VariantError: an unknown name (listing the valid ones) or an out-of-range value.
        """
        for name in overrides:
            if name not in self.param_names:
                raise VariantError(self._unknown_param_text(name))
        return {p.name: p.check(overrides.get(p.name, p.default), self.name) for p in self.params}

    def default_kv_len(self, q_len: int, **params: Any) -> int:
        """The key length to pair with ``q_len`` (differs for cross-attention variants)."""
        if self.kv_len is None:
            return q_len
        return int(self.kv_len(q_len, **self.resolve_params(**params)))

    def shape(self, B: int = 1, H: int = 8, Q_LEN: int = 1024, KV_LEN: int | None = None,
              device: str | torch.device = "cpu", **params: Any) -> Shape:
        """The Shape ``make`` builds for, checking the sizes."""
        if KV_LEN is None:
            KV_LEN = self.default_kv_len(Q_LEN, **params)
        for arg, value in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise VariantError(f"{self.name}: {arg} = {value!r}; expected a positive int")
        return Shape(B, H, Q_LEN, KV_LEN, torch.device(device))

    def make(self, *, B: int = 1, H: int = 8, Q_LEN: int = 1024, KV_LEN: int | None = None,
             device: str | torch.device = "cpu", **params: Any) -> Mods:
        """Build the mods (and their captured tensors) for a problem shape.

        Args:
            B, H, Q_LEN, KV_LEN, device: the problem the captured tensors are sized for
                (KV_LEN defaults to ``default_kv_len(Q_LEN)``).
            **params: overrides of the defaults, checked by ``resolve_params``.

        Example:
            >>> mods = variants.get("alibi_causal").make(H=16, Q_LEN=2048)
            >>> out = flex_attention(q, k, v, score_mod=mods.score_mod,
            ...                      block_mask=mods.create_block_mask())
        """
        values = self.resolve_params(**params)
        shape = self.shape(B, H, Q_LEN, KV_LEN, device, **values)
        mods = self.build(shape, **values)
        expected = {"mask": (False, True), "score": (True, False), "both": (True, True)}[self.kind]
        if ((mods.score_mod is not None), (mods.mask_mod is not None)) != expected:
            raise AssertionError(f"variant {self.name!r} of kind {self.kind!r} built {mods.name!r}")
        return Mods(mods.score_mod, mods.mask_mod, dict(mods.captured), shape,
                    self.batch_dependent, self.head_dependent, mods.sinks)

    def source(self, *, B: int = 1, H: int = 8, Q_LEN: int = 1024, KV_LEN: int | None = None,
               device: str | torch.device = "cpu", **params: Any) -> str:
        """A standalone Python snippet defining ``score_mod`` / ``mask_mod`` at these settings.

        It imports only torch, flexcore and (where needed) math, builds the captured tensors
        itself, and makes the same mods as ``make`` with the same arguments.
        """
        values = self.resolve_params(**params)
        shape = self.shape(B, H, Q_LEN, KV_LEN, device, **values)
        settings = ", ".join(f"{k}={v!r}" for k, v in values.items()) or "no parameters"
        recipe = self.recipe(**values) if callable(self.recipe) else self.recipe
        body = textwrap.dedent(recipe).strip().format(**{k: repr(v) for k, v in values.items()})
        functions = self.helpers(**values) if callable(self.helpers) else self.helpers
        helpers = "\n\n\n".join(textwrap.dedent(inspect.getsource(fn)).strip()
                                for fn in functions)
        flex_names = sorted(n for n in ("and_masks", "or_masks", "noop_mask")
                            if n in body or n in helpers)
        header = textwrap.fill(f"{self.title}: {self.reference}.", 96)
        lines = [f'"""{header}', "", textwrap.fill(f"Parameters: {settings}.", 96),
                 'Generated by flexlab\'s variant gallery."""']
        if "math." in helpers or "math." in body:
            lines.append("import math")
        lines.append("import torch")
        if flex_names:
            lines.append(f"from flexcore import {', '.join(flex_names)}")
        lines += ["", f"B, H, Q_LEN, KV_LEN = {shape.B}, {shape.H}, {shape.Q_LEN}, {shape.KV_LEN}",
                  f"device = torch.device({str(shape.device)!r})", ""]
        if helpers:
            lines += ["", helpers, "", ""]
        lines.append(body)
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        """Title, description, reference and parameters as plain text."""
        out = [f"{self.name}: {self.title} [{self.kind}]", textwrap.fill(self.description, 88),
               f"Reference: {self.reference}"]
        for p in self.params:
            out.append(f"  --{p.name} ({p.valid_text()}, default {p.default!r}): {p.help}")
        return "\n".join(out)
