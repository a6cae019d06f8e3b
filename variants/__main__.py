"""Command line of the gallery: ``python -m variants list`` and ``python -m variants show NAME``.

Examples:
    python -m variants list
    python -m variants show sliding_window --window_size 512 --seq 2048 --out mask.png
    python -m variants show bigbird --block-size 32 --plot-block-size 64 --out bigbird.png

Every ``--name value`` that is not one of ``show``'s own options below is a variant parameter
(dashes and underscores are the same): ``--block-size 32`` sets bigbird's ``block_size``. The
block size of the plotted block map is ``--plot-block-size``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flexcore.errors import FlexError
from variants.core import Variant, VariantError
from variants.registry import get, names

#: Largest preview: the token-mask and score panels hold Q_LEN × KV_LEN values each.
MAX_PREVIEW_LEN = 8192
MAX_PREVIEW_HEADS = 256  #: batch and heads of a preview (the captured tensors are sized for them)
#: Image formats ``--out`` may name (matplotlib writes each from the suffix).
OUT_SUFFIXES = (".png", ".svg", ".pdf")

#: Problem used by ``list`` for the default sparsity: two batch elements and two heads, so that
#: per-batch and per-head masks show their average.
LIST_BATCH, LIST_HEADS, LIST_BLOCK_SIZE = 2, 2, 128


def default_sparsity(variant: Variant, seq_len: int = 4096, block_size: int = LIST_BLOCK_SIZE,
                     **params) -> float:
    """Percentage of empty (skipped) blocks of the variant's mask at ``seq_len``."""
    mods = variant.make(B=LIST_BATCH, H=LIST_HEADS, Q_LEN=seq_len, **params)
    return mods.create_block_mask(BLOCK_SIZE=block_size).sparsity()


def list_table(seq_len: int = 4096, block_size: int = LIST_BLOCK_SIZE) -> str:
    """The gallery as a text table: name, kind, default sparsity, reference, title."""
    header = ("name", "kind", f"sparsity@{seq_len}", "reference", "title")
    rows = []
    for name in names():
        variant = get(name)
        sparsity = default_sparsity(variant, seq_len, block_size)
        rows.append((name, variant.kind, f"{sparsity:5.1f}%", variant.reference.short(),
                     variant.title))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [header, tuple("-" * w for w in widths)] + rows]
    lines.append(f"({len(rows)} variants; sparsity = empty blocks of {block_size}x{block_size} at "
                 f"Q_LEN = {seq_len}, B = {LIST_BATCH}, H = {LIST_HEADS})")
    return "\n".join(lines)


def parse_param_args(variant: Variant, tokens: list[str]) -> dict:
    """``["--window_size", "128", "--causal=false"]`` -> checked parameter values.

    Dashes and underscores are interchangeable in names.
    """
    values: dict = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise VariantError(f"{variant.name}: unexpected argument {token!r}; parameters are "
                               f"given as --name value")
        name, equals, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name == "block_size" and name not in variant.param_names:
            raise VariantError(f"{variant.name} has no parameter 'block_size'; the block size of the "
                               f"plotted block map is --plot-block-size")
        param = variant.param(name)  # raises with the list of valid parameters
        if not equals:
            if i + 1 >= len(tokens):
                raise VariantError(f"{variant.name}: --{name} needs a value "
                                   f"({param.valid_text()})")
            value = tokens[i + 1]
            i += 1
        values[name] = param.parse(value, variant.name)
        i += 1
    return variant.resolve_params(**values)


def check_out(out: str | Path) -> Path:
    """``--out``: an image file whose folder exists. Raises VariantError saying what is valid."""
    path = Path(out)
    if path.suffix.lower() not in OUT_SUFFIXES:
        raise VariantError(f"--out {str(out)!r}: expected a file ending in {', '.join(OUT_SUFFIXES)}")
    if path.is_dir():
        raise VariantError(f"--out {str(out)!r} is a folder; give a file name such as mask.png")
    folder = path.parent
    if not folder.is_dir():
        raise VariantError(f"--out {str(out)!r}: folder {str(folder)!r} does not exist; create it first")
    return path


def check_preview(seq_len: int, kv_len: int | None, block_size: int, batch: int, heads: int,
                  b: int, h: int) -> None:
    """The preview's sizes, before anything is allocated. Raises VariantError naming the flag."""
    for flag, value, high in (("--seq", seq_len, MAX_PREVIEW_LEN), ("--kv-seq", kv_len, MAX_PREVIEW_LEN),
                              ("--batch", batch, MAX_PREVIEW_HEADS), ("--heads", heads, MAX_PREVIEW_HEADS)):
        if value is None:
            continue
        if value < 1:
            raise VariantError(f"{flag} {value}: expected a positive integer")
        if value > high:
            raise VariantError(f"{flag} {value}: previews are capped at {high} (the plot draws every "
                               f"position; use `python -m variants describe` or flexcore for larger "
                               f"shapes)")
    if block_size < 1:
        raise VariantError(f"--plot-block-size {block_size}: expected a positive integer")
    if not (0 <= b < batch and 0 <= h < heads):
        raise VariantError(f"--b {b} / --h {h} must lie in [0, {batch}) / [0, {heads})")


def plotted_mask(mods, b: int, h: int) -> torch.Tensor:
    """The (Q_LEN, KV_LEN) bool mask of batch element ``b`` and head ``h`` alone: the mods see those
    indices, and nothing of size B·H·Q_LEN·KV_LEN is built."""
    from flexcore import create_mask, noop_mask

    mask_mod = mods.mask_mod or noop_mask

    def one(b_idx, h_idx, q_idx, kv_idx):
        return mask_mod(b_idx + b, h_idx + h, q_idx, kv_idx)

    return create_mask(one, 1, 1, mods.shape.Q_LEN, mods.shape.KV_LEN, device="cpu")[0, 0]


def show(name: str, params: dict, seq_len: int, out: str | Path, kv_len: int | None = None,
         block_size: int = 128, batch: int = 1, heads: int = 8, b: int = 0, h: int = 0) -> str:
    """Plot the token-level mask, the block map and (for score mods) the bias of one (b, h).

    Args:
        block_size: the block size of the plotted BlockMask (``--plot-block-size``), not a
            variant parameter.

    Returns:
        The text printed by the command: the mods' names and the block counts.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.ticker import MaxNLocator

    out = check_out(out)
    check_preview(seq_len, kv_len, block_size, batch, heads, b, h)
    variant = get(name)
    if kv_len is None and variant.default_kv_len(seq_len, **params) > MAX_PREVIEW_LEN:
        raise VariantError(f"{variant.name}'s key length at --seq {seq_len} is "
                           f"{variant.default_kv_len(seq_len, **params)}, over the preview cap "
                           f"{MAX_PREVIEW_LEN}; give a smaller --seq or --kv-seq")
    mods = variant.make(B=batch, H=heads, Q_LEN=seq_len, KV_LEN=kv_len, **params)
    shape = mods.shape
    block_mask = mods.create_block_mask(BLOCK_SIZE=block_size)
    mb, mh = (b if mods.batch_dependent else 0), (h if mods.head_dependent else 0)
    block_map = block_mask.block_map()[mb, mh]
    dense = plotted_mask(mods, b, h)

    panels = 3 if mods.score_mod is not None else 2
    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 5.0))
    axes[0].imshow(dense.numpy(), cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    axes[0].set_title(f"token mask (b={b}, h={h})")
    block_colours = ListedColormap(["#f4f4f4", "#f2a93b", "#2b6cb0"])
    axes[1].imshow(block_map.numpy(), cmap=block_colours, vmin=0, vmax=2,
                   interpolation="nearest")
    counts = block_mask.counts()
    axes[1].set_title(f"blocks {block_size}: full (blue) / partial (orange) / empty")
    if mods.score_mod is not None:
        q_idx = torch.arange(shape.Q_LEN)[:, None]
        kv_idx = torch.arange(shape.KV_LEN)[None, :]
        with torch.no_grad():
            bias = mods.score_mod(torch.zeros(shape.Q_LEN, shape.KV_LEN), torch.tensor(b),
                                  torch.tensor(h), q_idx, kv_idx)
            bias = bias.masked_fill(~dense, float("nan")).expand(shape.Q_LEN, shape.KV_LEN)
        image = axes[2].imshow(bias.numpy(), cmap="viridis", interpolation="nearest")
        axes[2].set_title(f"score_mod(0, b={b}, h={h}, q, kv)")
        figure.colorbar(image, ax=axes[2], fraction=0.046)
    axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in axes:
        axis.set_xlabel("kv_idx" if axis is not axes[1] else "kv block")
        axis.set_ylabel("q_idx" if axis is not axes[1] else "q block")
    figure.suptitle(f"{variant.title}: {mods.name} (Q_LEN={shape.Q_LEN}, KV_LEN={shape.KV_LEN})",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return (f"{variant.name}: {mods.name}\n"
            f"shape B={batch} H={heads} Q_LEN={shape.Q_LEN} KV_LEN={shape.KV_LEN}, "
            f"BLOCK_SIZE={block_size}\n"
            f"blocks: full={counts.full} partial={counts.partial} empty={counts.empty} "
            f"(sparsity {block_mask.sparsity():.1f}%)\n"
            f"wrote {out}")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: ...``, exit status 2). Options are never
    abbreviated: ``show`` passes every unknown ``--name`` on to the variant."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m variants", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    listing = commands.add_parser("list", help="table of every variant")
    listing.add_argument("--seq", type=int, default=4096, help="sequence length for sparsity")
    describe = commands.add_parser("describe", help="a variant's description and parameters")
    describe.add_argument("name")
    shower = commands.add_parser(
        "show", help="plot a variant's mask and block map",
        description="Plot a variant's token mask and block map. Variant parameters are given as "
                    "--name value (see `describe NAME`); dashes and underscores are the same, so "
                    "--block-size sets a variant's block_size. The plot's own block size is "
                    "--plot-block-size.")
    shower.add_argument("name")
    shower.add_argument("--seq", type=int, default=1024,
                        help=f"query length (default 1024, at most {MAX_PREVIEW_LEN})")
    shower.add_argument("--kv-seq", type=int, default=None, help="key length (default: the "
                        f"variant's own, usually --seq; at most {MAX_PREVIEW_LEN})")
    shower.add_argument("--plot-block-size", type=int, default=128,
                        help="block size of the plotted block map (default 128); not a variant "
                             "parameter")
    shower.add_argument("--batch", type=int, default=1)
    shower.add_argument("--heads", type=int, default=8)
    shower.add_argument("--b", type=int, default=0, help="batch element to plot")
    shower.add_argument("--h", type=int, default=0, help="head to plot")
    shower.add_argument("--out", required=True,
                        help=f"image to write ({', '.join(OUT_SUFFIXES)}), in an existing folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command != "show" and rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "list":
            print(list_table(args.seq))
        elif args.command == "describe":
            print(get(args.name).summary())
        else:
            variant = get(args.name)
            params = parse_param_args(variant, rest)
            print(show(variant.name, params, args.seq, args.out, kv_len=args.kv_seq,
                       block_size=args.plot_block_size, batch=args.batch, heads=args.heads,
                       b=args.b, h=args.h))
    except (VariantError, FlexError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
