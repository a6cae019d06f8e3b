"""Forward-pass benchmark on the anchors grid: flexcore against torch flex (compiled, Triton) and SDPA.

A thin entry over the runner: the ``anchors`` preset restricted to the forward pass (and decoding,
with ``--decode``), providers flexlab, torch_flex, sdpa_flash and sdpa_cudnn. Writes results.json /
results.csv into ``--out`` and prints the summary table; exits as ``python -m bench run`` does
(1 when nothing was measured or a correctness check failed).

Example:
    python -m bench.forward --out results/forward
"""
from __future__ import annotations

import argparse
import sys

PROVIDERS = ["flexlab", "torch_flex", "sdpa_flash", "sdpa_cudnn"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.forward", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/forward", help="output folder")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run")
    parser.add_argument("--force", action="store_true", help="replace a previous run in --out")
    parser.add_argument("--decode", action="store_true", help="also run the decode rows")
    parser.add_argument("--variants", help="comma-separated subset of the anchor variants")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="stop starting cases after this long (then --resume)")
    return parser


def build(args):
    """The grid: the anchors preset, forward (and decode) only, on the chosen providers."""
    from bench.__main__ import _csv, _variants
    from bench.grid import build_grid, load_config

    passes = ["fwd", "decode"] if args.decode else ["fwd"]
    return build_grid(load_config("anchors"), "anchors-forward", variants=_variants(args.variants),
                      passes=passes, providers=_csv(args.providers),
                      settings={"max_minutes": args.max_minutes})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bench.__main__ import guarded

    return guarded(lambda: _run(args))


def _run(args) -> int:
    from bench import runner
    from bench.report import print_summary

    path = runner.run(build(args), args.out, resume=args.resume, force=args.force)
    print_summary(path)
    result = runner.verdict(runner.load_results(path)["rows"])
    print(result.summary(), file=sys.stderr)
    return result.exit_code()


if __name__ == "__main__":
    sys.exit(main())
