"""Command line: ``python -m bench run|report|summary|first-call|list-presets|list-providers``.

Examples:
    python -m bench run --config tiny --out results/tiny
    python -m bench run --config anchors --out results/anchors --max-minutes 8 --resume
    python -m bench run --config anchors --processes 3 --out results/anchors-spread   # run-to-run spread
    python -m bench run --variants causal,alibi+causal --seq 1024 --heads 8 --head-dim 64 \\
        --dtype bf16 --passes fwd --providers flexlab,sdpa_math
    python -m bench report results/anchors --out reports/anchors
    python -m bench report results/h100 results/h200 --out reports/compare
    python -m bench summary results/anchors
    python -m bench first-call --out results/first-call

Exit status: 0 when the run measured something and every correctness check passed; 1 when no
provider measured any case, a check failed (``--keep-going`` accepts failed checks) or a process of
``--processes`` failed; 2 for bad
input (a config, a flag, a device, a results file) or an output folder that is in use or holds
another run, each with a one-line message; 130 on Ctrl-C (one line: where the finished cases are,
and ``--resume``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str | None, flag: str = "") -> list[int] | None:
    from bench.grid import ConfigError

    items = _csv(text)
    if items is None:
        return None
    values = []
    for t in items:
        try:
            value = int(t)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"{flag} {text!r}: expected comma-separated positive integers")
        values.append(value)
    if not values:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated positive integers")
    return values


def _listed(items: list[str] | None, flag: str) -> list[str] | None:
    """``items`` of a list flag that was given; an empty one (``--variants ""``) is an error, not
    "no filter": an empty filter would otherwise run the whole grid."""
    from bench.grid import ConfigError

    if items is not None and not items:
        raise ConfigError(f"{flag} is empty: give comma-separated values, or leave {flag} out")
    return items


def _variants(text: str | None) -> list[str] | None:
    """Comma-separated specs; commas inside parentheses belong to the parameters."""
    if text is None:
        return None
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


class Interrupted(Exception):
    """Ctrl-C: the message says what was kept and how to go on (exit status 130)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: ...``, exit status 2), like the rest of the CLI."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from bench.grid import preset_names

    parser = _Parser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("run", help="run a benchmark grid and write long-form results")
    r.add_argument("--config", help=f"preset name ({', '.join(preset_names())}) or a .toml/.yaml/.json "
                                    "file; default: a single group from the grid flags")
    r.add_argument("--out", help="output folder (default results/<config name>)")
    r.add_argument("--resume", action="store_true", help="continue a run in --out, skipping finished cases")
    r.add_argument("--force", action="store_true", help="replace a previous run in --out")
    r.add_argument("--variants", help="comma-separated variant specs (registry names, a+b, name(k=v), mods.py)")
    r.add_argument("--providers", help="comma-separated providers (see list-providers)")
    r.add_argument("--passes", help="comma-separated: fwd, fwd_bwd, decode, fp8, train_step")
    r.add_argument("--dtype", help="comma-separated: float32/fp32, bfloat16/bf16, float16/fp16")
    r.add_argument("--batch", help="comma-separated batch sizes")
    r.add_argument("--seq", help="comma-separated sequence lengths (Q_LEN = KV_LEN)")
    r.add_argument("--q-len", help="comma-separated query lengths")
    r.add_argument("--kv-len", help="comma-separated key lengths")
    r.add_argument("--heads", help="comma-separated query head counts")
    r.add_argument("--kv-heads", help="comma-separated KV head counts (GQA)")
    r.add_argument("--head-dim", help="comma-separated head dims")
    r.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    r.add_argument("--max-minutes", type=float, help="stop starting cases after this long (resume later)")
    r.add_argument("--rep-ms", type=float, help="GPU timing budget per provider and case")
    r.add_argument("--ref-slices", type=int, help="(batch, kv-head) slices checked against float64 (0: all)")
    r.add_argument("--mask-budget-gb", type=float, help="largest dense mask/bias for SDPA, GiB")
    r.add_argument("--seed", type=int)
    r.add_argument("--cuda-graphs", help="passes timed by replaying CUDA graphs: comma-separated passes, "
                   "'all' or 'none' (default: decode)")
    pin = r.add_mutually_exclusive_group()
    pin.add_argument("--pin-host", dest="pin_host", action="store_const", const=True,
                     help="time on the GPU with the process's threads on one core: less host time and "
                          "spread than a training loop sees (docs/decisions.md#host-pinning)")
    pin.add_argument("--no-pin-host", dest="pin_host", action="store_const", const=False,
                     help="time unpinned, the way a training loop runs (the default)")
    r.add_argument("--no-progress", action="store_true", help="log one line per case instead of a bar")
    r.add_argument("--keep-going", action="store_true",
                   help="exit 0 even when correctness checks failed (the results still mark them)")
    r.add_argument("--processes", type=_positive,
                   help="run the grid in N fresh processes one after another (N >= 2) and report the "
                        "run-to-run spread of each row (bench/spread.py)")

    p = sub.add_parser("report", help="write HTML, markdown, PNG and CSV reports of one or more runs")
    p.add_argument("results", nargs="+", help="results.json / results.csv files or run folders")
    p.add_argument("--out", required=True, help="report folder")
    p.add_argument("--force", action="store_true", help="overwrite an existing report folder")
    p.add_argument("--labels", help="comma-separated names of the runs (default: GPU @ commit)")
    p.add_argument("--baseline", help="provider the speed-ups are relative to (default: torch_flex, "
                                      "else the first of sdpa_cudnn, sdpa_flash, sdpa_math present)")

    sm = sub.add_parser("summary", help="print the summary table (markdown) of one or more runs")
    sm.add_argument("results", nargs="+", help="results.json / results.csv files or run folders")
    sm.add_argument("--labels", help="comma-separated names of the runs")

    f = sub.add_parser("first-call", help="time a new mod's first result (trace, generate, compile) "
                                          "with cold caches, one fresh process per provider")
    f.add_argument("--variants", help="comma-separated variant specs (default: the anchors variants)")
    f.add_argument("--providers", help="comma-separated providers (default: flexlab,torch_flex)")
    f.add_argument("--batch", type=_positive, default=4)
    f.add_argument("--heads", type=_positive, default=16)
    f.add_argument("--seq", type=_positive, default=4096)
    f.add_argument("--head-dim", type=_positive, default=128)
    f.add_argument("--dtype", default="bf16", help="float32/fp32, bfloat16/bf16, float16/fp16")
    f.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    f.add_argument("--out", help="folder for results.json and summary.md (default: print only)")
    f.add_argument("--force", action="store_true", help="replace results in --out")

    sub.add_parser("list-presets", help="show the named grids")
    lp = sub.add_parser("list-providers", help="show which providers run on this machine")
    lp.add_argument("--device")
    return parser


# Shape flags: each takes a comma-separated list of ints and overrides that axis of the grid.
_SHAPE_FLAGS = ("batch", "seq", "q_len", "kv_len", "heads", "kv_heads", "head_dim")


def _run(args) -> int:
    from bench import grid as grid_mod
    from bench import runner, spread

    for flag, items in (("--variants", _variants(args.variants)), ("--providers", _csv(args.providers)),
                        ("--passes", _csv(args.passes)), ("--dtype", _csv(args.dtype))):
        _listed(items, flag)
    overrides = {name: _ints(getattr(args, name), "--" + name.replace("_", "-"))
                 for name in _SHAPE_FLAGS if getattr(args, name) is not None}
    device = grid_mod.check_device(args.device)
    settings = {k: v for k, v in (("max_minutes", args.max_minutes), ("rep_ms", args.rep_ms),
                                  ("ref_slices", args.ref_slices), ("mask_budget_gb", args.mask_budget_gb),
                                  ("seed", args.seed), ("cuda_graphs", args.cuda_graphs),
                                  ("pin_host", args.pin_host)) if v is not None}
    if args.config:
        config = grid_mod.load_config(args.config)
        name = Path(args.config).stem if args.config not in grid_mod.PRESETS else args.config
    else:
        if not args.variants:
            raise grid_mod.ConfigError("give --config (a preset or file) or at least --variants")
        config = {"groups": [{"variants": ["noop"], "batch": [1], "seq": [1024], "heads": [8],
                              "head_dim": [64], "dtype": ["bfloat16"], "passes": ["fwd"]}],
                  "providers": ["flexlab", "torch_flex", "sdpa_math", "sdpa_flash", "sdpa_cudnn"]}
        name = "custom"
        # Without a config the flags define the grid; with one they filter it.
        if args.passes:
            overrides["passes"] = _csv(args.passes)
        if args.dtype:
            overrides["dtype"] = _csv(args.dtype)
    grid = grid_mod.build_grid(config, name, variants=_variants(args.variants),
                               passes=_csv(args.passes) if args.config else None,
                               providers=_csv(args.providers),
                               dtypes=_csv(args.dtype) if args.config else None,
                               overrides=overrides or None, settings=settings)
    if not grid.cases:
        raise grid_mod.ConfigError("the grid has no cases after the --passes/--dtype filters")
    out = Path(args.out or Path("results") / grid.name)
    if args.processes is not None and args.processes < 2:
        raise grid_mod.ConfigError(f"--processes {args.processes}: expected an integer >= 2 (one process "
                                   "is a plain run: leave --processes out)")
    print(f"{len(grid.cases)} cases × {len(grid.providers)} providers"
          + (f" × {args.processes} processes" if args.processes else "") + f" -> {out}", file=sys.stderr)
    try:
        if args.processes:
            path = spread.run_processes(grid, out, args.processes, device=device, resume=args.resume,
                                        force=args.force, progress=not args.no_progress)
        else:
            path = runner.run(grid, out, device=device, resume=args.resume, force=args.force,
                              progress=not args.no_progress)
    except KeyboardInterrupt:
        # The finished cases are fsynced as they end (the interrupted one is redone): say where.
        kept = out / spread.PROCESSES_DIR / "<k>" / "rows.jsonl" if args.processes else out / "rows.jsonl"
        raise Interrupted(f"the finished cases are kept in {kept}; run the same command with --resume "
                          "to continue") from None
    print(path)
    data = runner.load_results(path)
    rows = data["rows"]
    if args.processes:
        print(spread.summary_line(rows), file=sys.stderr)
        if not data.get("complete"):  # stopped by --max-minutes: judge what the processes measured
            rows = spread.process_rows(out)
    result = runner.verdict(rows)
    code = result.exit_code(args.keep_going)
    print(("" if code == 0 else "error: ") + result.summary()
          + (" (--keep-going)" if args.keep_going and result.failed_checks and code == 0 else ""),
          file=sys.stderr)
    return code


def _report(args) -> int:
    from bench import report

    paths = report.write_report(args.results, args.out, force=args.force, labels=_csv(args.labels),
                                baseline=args.baseline)
    for path in paths:
        print(path)
    return 0


def _first_call(args, argv: list[str]) -> int:
    import shlex

    import torch

    from bench import first_call
    from bench.grid import ANCHOR_VARIANTS, ConfigError, _norm_dtype
    from bench.providers import PROVIDERS
    from bench.runner import default_device

    for flag, items in (("--variants", _variants(args.variants)), ("--providers", _csv(args.providers))):
        _listed(items, flag)
    providers = _csv(args.providers) or ["flexlab", "torch_flex"]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ConfigError(f"unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
    shape = first_call.Shape(args.batch, args.heads, args.seq, args.head_dim, _norm_dtype(args.dtype))
    device = args.device or default_device().type
    try:
        device_type = torch.device(device).type
    except RuntimeError:
        device_type = None
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: expected cpu or cuda")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r}: no CUDA GPU on this machine")
    rows = first_call.measure(providers, _variants(args.variants) or ANCHOR_VARIANTS, shape, device)
    print(first_call.table(rows))
    if args.out:
        from bench.env import capture, label

        env = capture(device)
        meta = {"shape": f"B={shape.batch}, H={shape.heads}, S={shape.seq}, D={shape.head_dim}, {shape.dtype}",
                "command": "python -m bench " + shlex.join(argv),
                "gpu": label(env), "environment": env}
        for path in first_call.write(rows, Path(args.out), force=args.force, meta=meta):
            print(path)
    return 0


def guarded(command) -> int:
    """``command()``'s exit status, with the bench's own errors as one line on stderr instead of a
    traceback: 2 for bad input (config, variant, run folder, results file), 1 for a failed
    first-call or spread run, 130 for Ctrl-C."""
    from bench.first_call import FirstCallError
    from bench.grid import ConfigError
    from bench.mods import VariantError
    from bench.report import ReportError
    from bench.runner import ResultsFileError, RunDirError
    from bench.spread import SpreadError

    try:
        return command()
    except (ConfigError, VariantError, RunDirError, ReportError, ResultsFileError, FileNotFoundError,
            FileExistsError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (FirstCallError, SpreadError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except Interrupted as exc:  # 130 = 128 + SIGINT, what a shell reports for Ctrl-C
        print(f"interrupted: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return guarded(lambda: _command(args, argv))


def _command(args, argv) -> int:
    """Run the parsed subcommand."""
    if args.command == "run":
        return _run(args)
    if args.command == "report":
        return _report(args)
    if args.command == "first-call":
        return _first_call(args, sys.argv[1:] if argv is None else argv)
    if args.command == "summary":
        from bench.report import print_summary

        print_summary(args.results, _csv(args.labels))
        return 0
    if args.command == "list-presets":
        from bench.grid import PRESET_HELP, build_grid, load_config

        for name in sorted(PRESET_HELP):
            grid = build_grid(load_config(name), name)
            print(f"{name:12s} {len(grid.cases):4d} cases  {PRESET_HELP[name]}")
        return 0
    if args.command == "list-providers":
        from bench.grid import check_device
        from bench.providers import PROVIDERS, availability

        device = check_device(args.device)
        for name, (ok, why) in availability(device).items():
            print(f"{name:18s} {'yes' if ok else 'no ':3s} {why}  [{PROVIDERS[name].description}]")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
