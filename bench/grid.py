"""The benchmark grid: cases, run settings, named presets and TOML/YAML config files.

A config is a mapping (TOML, YAML or a preset) like::

    name = "my-grid"
    providers = ["flexlab", "sdpa_math"]
    [settings]
    rep_ms = 100
    [[groups]]
    variants = ["causal", "alibi+causal", "sliding_window(window=S//4)+causal", "mods.py"]
    shapes = [[4, 4096], [2, 128, 256]]   # [batch, seq] or [batch, q_len, kv_len]
    heads = [16, [32, 8]]                 # query heads, or [query heads, kv heads] for GQA
    head_dim = [128]                      # or [D, Dv]
    dtype = ["bfloat16"]
    passes = ["fwd", "fwd_bwd"]           # and/or "decode", "fp8"

Each group is the Cartesian product of its lists; the grid is the union of its groups.
Variant specs are described in :mod:`bench.mods`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.flops import PASS_FACTORS

DTYPES = ("float32", "bfloat16", "float16")
#: The FP8 forward: the case's bfloat16 inputs quantized to float8_e4m3fn with per-head descales
#: (bench.context), attended by providers that take FP8 (bfloat16 output); its FLOPs are a forward's.
FP8_PASS = "fp8"
#: Passes that time one attention call: those of :data:`bench.flops.PASS_FACTORS`, and ``fp8``.
ATTENTION_PASSES = (*PASS_FACTORS, FP8_PASS)
#: The passes of a case: the attention passes, and ``train_step``, one transformer block's
#: forward+backward (:mod:`bench.train_step`).
PASSES = (*ATTENTION_PASSES, "train_step")
#: torch.compile backends of flexlab_compiled and of train-step blocks.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
_PASS_ALIASES = {"forward": "fwd", "forward+backward": "fwd_bwd", "fwd+bwd": "fwd_bwd",
                 "backward": "fwd_bwd", "bwd": "fwd_bwd", "train-step": "train_step",
                 "fp8_fwd": "fp8", "fp8-forward": "fp8", "float8": "fp8"}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a variant on one shape, dtype and pass.

    Shapes: query (batch, q_heads, q_len, head_dim), key (batch, kv_heads, kv_len, head_dim),
    value (batch, kv_heads, kv_len, v_head_dim).
    """

    variant: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dtype: str
    pass_: str

    @property
    def case_id(self) -> str:
        """Stable text key of the case (used to resume runs and to join result files)."""
        return (f"{self.variant}|B{self.batch}|H{self.q_heads}/{self.kv_heads}|Q{self.q_len}"
                f"|KV{self.kv_len}|D{self.head_dim}/{self.v_head_dim}|{self.dtype}|{self.pass_}")

    @property
    def gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def validate(self) -> None:
        for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} in case {self.case_id}: expected a positive integer")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads} "
                              f"in case {self.case_id}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} in case {self.case_id}: expected one of {DTYPES}")
        if self.pass_ not in PASSES:
            raise ConfigError(f"pass={self.pass_!r} in case {self.case_id}: expected one of {list(PASSES)}")
        if self.pass_ == FP8_PASS and self.dtype != "bfloat16":
            raise ConfigError(f"case {self.case_id}: the fp8 pass quantizes bfloat16 inputs to "
                              f"float8_e4m3fn and returns bfloat16; give it dtype bfloat16 (a group "
                              f"may list fp8 beside fwd with dtype ['bfloat16'])")
        if self.pass_ == "train_step" and (self.q_len != self.kv_len or self.head_dim != self.v_head_dim):
            raise ConfigError(f"case {self.case_id}: a train_step case is one self-attention block, so "
                              "q_len must equal kv_len and head_dim its value head dim")


@dataclass
class Settings:
    """How cases are measured (see docs/decisions.md for the trade-offs). :meth:`validate` checks
    every field's type and range."""

    warmup_ms: float = 25.0  #: GPU warm-up time before timing, per provider and case
    rep_ms: float = 100.0  #: GPU timing budget; reps = rep_ms / estimated time, clamped below
    min_reps: int = 10
    max_reps: int = 200
    cpu_reps: int = 5  #: wall-clock repetitions on the CPU (the interpreter is slow)
    ref_slices: int = 2  #: (batch, kv-head) slices checked against fp64; 0 checks them all
    ref_full_elements: int = 1 << 26  #: check it all when B·Hq·Lq·Lk and B·Hq·Lk·(D+Dv) are ≤ this
    mask_budget_gb: float = 16.0  #: largest dense mask/bias materialised for SDPA, in GiB
    block_size: int = 128  #: BlockMask block size (FLOP density counts these blocks)
    seed: int = 0
    max_minutes: float = 0.0  #: stop starting new cases after this long (0: no limit)
    #: passes timed by replaying CUDA graphs (comma-separated; "" for none). Decoding steps are
    #: short enough that eager timing measures the host's launch work as much as the GPU's.
    cuda_graphs: str = "decode"
    #: on the GPU, time with the process's threads on one core (bench.timing.pinned_host): the host's
    #: time per call halves and spreads less (docs/decisions.md#host-pinning). Off by default: the
    #: headline is what a training loop, whose threads are not pinned, pays.
    pin_host: bool = False
    #: time a case's providers in this many interleaved rounds (each with its warm-up and a share of
    #: rep_ms, min_reps and max_reps; the repetitions pooled), so that a drift of the host or the
    #: GPU's clocks during the case falls on every provider alike; 1: each provider at once. Not
    #: for passes timed under CUDA graphs or train_step cases (bench/README.md)
    rounds: int = 1
    #: torch.compile backend of the flexlab_compiled provider and of train-step blocks; inductor
    #: is what training runs use, aot_eager traces the same graphs without code generation
    #: (seconds instead of a minute on a CPU)
    compile_backend: str = "inductor"

    def graph_passes(self) -> set[str]:
        """The passes in :attr:`cuda_graphs` ("all" means fwd, fwd_bwd and decode; fp8 is given by
        name). Raises ConfigError for a name that is not a pass."""
        if not isinstance(self.cuda_graphs, str):
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r}: expected a string of comma-separated "
                              "passes, 'all' or 'none'")
        names = {p.strip() for p in self.cuda_graphs.split(",") if p.strip()}
        if names - set(ATTENTION_PASSES) - {"all", "none"}:
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r}: expected comma-separated passes from "
                              f"{sorted(ATTENTION_PASSES)}, 'all' or 'none'")
        # "all" keeps its meaning, the passes of bench.flops.PASS_FACTORS; fp8 is named.
        return set(PASS_FACTORS) if "all" in names else names - {"none"}

    def validate(self) -> "Settings":
        """Check every field's type and range; raise ConfigError naming the first bad one."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = type(f.default)
            if kind is bool:
                ok = isinstance(value, bool)
                expected = "true or false"
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
                expected = "an integer"
            elif kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                expected = "a finite number"
            else:
                ok = isinstance(value, str)
                expected = "a string"
            if not ok:
                raise ConfigError(f"setting {f.name}={value!r}: expected {expected}")
            low, high, words = _SETTING_RANGES.get(f.name, (None, None, ""))
            if (low is not None and value < low) or (high is not None and value > high):
                raise ConfigError(f"setting {f.name}={value!r}: expected {words}")
        if self.max_reps < self.min_reps:
            raise ConfigError(f"setting max_reps={self.max_reps} is below min_reps={self.min_reps}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"setting block_size={self.block_size}: expected a power of two in [16, 1024]")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(f"setting compile_backend={self.compile_backend!r}: expected one of "
                              f"{list(COMPILE_BACKENDS)}")
        self.graph_passes()
        return self


#: field -> (lowest, highest, what is valid in words); None: unbounded on that side.
_SETTING_RANGES = {
    "warmup_ms": (0, None, "a number >= 0"),
    "rep_ms": (1e-3, None, "a number > 0"),
    "min_reps": (1, None, "an integer >= 1"),
    "max_reps": (1, None, "an integer >= 1"),
    "cpu_reps": (1, None, "an integer >= 1"),
    "rounds": (1, 100, "an integer in [1, 100]"),
    "ref_slices": (0, None, "an integer >= 0 (0 checks every slice)"),
    "ref_full_elements": (0, None, "an integer >= 0 (0: always check slices)"),
    "mask_budget_gb": (1e-6, None, "a number of GiB > 0"),
    "block_size": (16, 1024, "a power of two in [16, 1024]"),
    "seed": (0, 2**63 - 1, "an integer in [0, 2**63)"),
    "max_minutes": (0, None, "a number of minutes >= 0 (0: no limit)"),
}


@dataclass
class Grid:
    name: str
    cases: list[Case]
    providers: list[str]
    settings: Settings = field(default_factory=Settings)

    def to_dict(self) -> dict:
        """The expanded grid as JSON-able data (config.json), with its :func:`fingerprint`."""
        data = {"name": self.name, "providers": list(self.providers),
                "settings": dataclasses.asdict(self.settings),
                "cases": [dataclasses.asdict(c) for c in self.cases]}
        data["fingerprint"] = fingerprint(data)
        return data


def case_from_dict(data: dict) -> Case:
    """The :class:`Case` of a config.json entry (``pass_`` or ``pass``)."""
    data = {**data, "pass_": data.get("pass_", data.get("pass"))}
    return Case(**{f.name: data.get(f.name) for f in dataclasses.fields(Case)})


#: Settings that do not change what a run measures: a resumed segment may change them.
_SEGMENT_SETTINGS = ("max_minutes",)


def normalized(config: dict) -> dict:
    """What identifies a run's measurements, from a :meth:`Grid.to_dict` mapping: the set of case
    ids, the set of providers, the settings (defaults filled in, ``max_minutes`` left out) and,
    for a run of several processes (``run --processes N``), their count."""
    cases = [case_from_dict(c).case_id for c in config.get("cases") or []]
    settings = {**dataclasses.asdict(Settings()), **(config.get("settings") or {})}
    for f in dataclasses.fields(Settings):  # 100 and 100.0 are the same rep_ms
        value = settings.get(f.name)
        if type(f.default) is float and isinstance(value, int) and not isinstance(value, bool):
            settings[f.name] = float(value)
    for key in _SEGMENT_SETTINGS:
        settings.pop(key, None)
    out = {"cases": sorted(set(cases)), "providers": sorted(set(config.get("providers") or [])),
           "settings": settings}
    # Only a count above 1 is recorded, so that a plain run's fingerprint stays what it was.
    if config.get("processes") not in (None, 1):
        out["processes"] = config["processes"]
    return out


def fingerprint(config: dict) -> str:
    """sha256 of :func:`normalized` ``config``: equal exactly when two runs measure the same thing."""
    text = json.dumps(normalized(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_differences(stored: dict, current: dict) -> list[str]:
    """The keys whose values differ between two :meth:`Grid.to_dict` mappings, in words."""
    old, new = normalized(stored), normalized(current)
    out = []
    for key in ("cases", "providers"):
        added = sorted(set(new[key]) - set(old[key]))
        removed = sorted(set(old[key]) - set(new[key]))
        if added or removed:
            parts = [f"{len(added)} added (e.g. {added[0]!r})" if added else "",
                     f"{len(removed)} removed (e.g. {removed[0]!r})" if removed else ""]
            out.append(f"{key}: " + ", ".join(p for p in parts if p))
    for key in sorted(set(old["settings"]) | set(new["settings"])):
        if old["settings"].get(key) != new["settings"].get(key):
            out.append(f"settings.{key}: {old['settings'].get(key)!r} -> {new['settings'].get(key)!r}")
    if old.get("processes", 1) != new.get("processes", 1):
        out.append(f"processes: {old.get('processes', 1)} -> {new.get('processes', 1)} (--processes N)")
    return out


class ConfigError(ValueError):
    """A grid config or command-line grid flag is malformed."""


ANCHOR_VARIANTS = [
    "noop",
    "causal",
    "alibi_causal",
    "sliding_window(window_size=1024)",  # causal by definition
    "prefix_lm(prefix_fraction=0.25)",  # batch element b: prefix (b + 1) / B · S/4
    "document(num_documents=8)",  # causal within each document by default
    "softcap_causal(softcap=30)",
]
ANCHOR_PROVIDERS = ["flexlab", "torch_flex", "torch_flex_flash", "flash4", "flash_attn", "sdpa_cudnn",
                    "sdpa_flash", "flexlab_paged"]
_ANCHOR_DECODE = {
    "variants": ["noop", "alibi", "sliding_window(window_size=1024)"],
    "shapes": [[8, 1, 8192], [8, 1, 65536]], "heads": [[32, 8]], "head_dim": [128],
    "dtype": ["bfloat16"], "passes": ["decode"],
}


def _anchors(head_dims: list[int]) -> dict:
    return {
        "providers": ANCHOR_PROVIDERS,
        # Three interleaved rounds: a slowdown of the host or GPU within one timing window is
        # outvoted by the other two rounds' repetitions (docs/decisions.md#host-pinning).
        "settings": {"warmup_ms": 25, "rep_ms": 100, "min_reps": 10, "max_reps": 100,
                     "ref_slices": 1, "rounds": 3},
        "groups": [
            {"variants": ANCHOR_VARIANTS, "shapes": [[4, 4096], [1, 16384]], "heads": [16],
             "head_dim": head_dims, "dtype": ["bfloat16"], "passes": ["fwd", "fwd_bwd"]},
            _ANCHOR_DECODE,
        ],
    }


#: The masks language models train with, and flexcore eager / compiled against torch flex compiled.
SMALL_VARIANTS = ["causal", "alibi_causal", "document(num_documents=4)"]
SMALL_PROVIDERS = ["flexlab", "flexlab_compiled", "torch_flex"]


PRESETS: dict[str, dict] = {
    # The anchors grid (docs/benchmark-method.md) (bf16, D=128, H=16, 16k tokens per batch) and its decode rows.
    "anchors": _anchors([128]),
    # The same with D=64 as well (about twice as long).
    "anchors-d64": _anchors([64]),
    # The decode rows of the anchors grid alone (contiguous and paged caches).
    "decode": {"providers": ANCHOR_PROVIDERS, "settings": _anchors([128])["settings"],
               "groups": [_ANCHOR_DECODE]},
    # CPU-sized: flexlab under Triton's interpreter against SDPA math, for CI (< 2 minutes).
    "tiny": {
        "providers": ["flexlab", "flexlab_paged", "sdpa_math"],
        "settings": {"cpu_reps": 2, "ref_slices": 0},
        "groups": [
            # GQA (4 query heads on 2 KV heads) in both dtypes: a score_mod over the causal mask,
            # and a window (the causal mask alone runs in the cross-attention group below).
            {"variants": ["alibi_causal", "sliding_window(window_size=48)"],
             "shapes": [[1, 128]], "heads": [[4, 2]], "head_dim": [32],
             "dtype": ["float32", "bfloat16"], "passes": ["fwd", "fwd_bwd"]},
            # Cross-attention lengths (Q != KV, neither a block multiple) with a batch of 2.
            # relative_bias has a learnable table: its gradient is compared too.
            {"variants": ["causal", "relative_bias(max_distance=16)"], "shapes": [[2, 48, 80]],
             "heads": [2],
             "head_dim": [16], "dtype": ["float32"], "passes": ["fwd", "fwd_bwd"]},
            {"variants": ["noop", "alibi"], "shapes": [[2, 1, 256]], "heads": [[4, 2]],
             "head_dim": [32], "dtype": ["float32"], "passes": ["decode"]},
        ],
    },
    # Training shapes: S 512-2048, D 64/128, B·H 8-64 (8, 16 two ways, 32 two ways, 64). Timed
    # unpinned, the way a training loop runs, the providers in interleaved rounds: host-bound rows
    # move with the host's state, which the rounds spread over every provider.
    "small": {
        "providers": SMALL_PROVIDERS,
        "settings": {"warmup_ms": 25, "rep_ms": 150, "min_reps": 15, "max_reps": 300,
                     "ref_slices": 1, "pin_host": False, "rounds": 5},
        "groups": [
            {"variants": SMALL_VARIANTS, "shapes": [[1, 512], [2, 1024], [4, 2048]],
             "heads": [8, 16], "head_dim": [64, 128], "dtype": ["bfloat16"],
             "passes": ["fwd", "fwd_bwd"]},
        ],
    },
    # The FP8 forward beside bf16's (issue 37's target: FP8 >= 1.4x bf16 at 16k, noop and causal,
    # D=128), with FlashAttention-3's FP8 flash_attn_func where the flash_attn provider finds it.
    "fp8": {
        "providers": ["flexlab", "flash_attn", "sdpa_cudnn"],
        "settings": {"warmup_ms": 25, "rep_ms": 100, "min_reps": 10, "max_reps": 100,
                     "ref_slices": 1},
        "groups": [
            {"variants": ["noop", "causal", "alibi_causal", "sliding_window(window_size=1024)"],
             "shapes": [[4, 4096], [1, 16384]], "heads": [16], "head_dim": [128],
             "dtype": ["bfloat16"], "passes": ["fwd", "fp8"]},
        ],
    },
    # One transformer block (RMSNorm, attention, MLP) compiled, forward+backward: tokens/s.
    "train-step": {
        "providers": SMALL_PROVIDERS,
        "settings": {"warmup_ms": 25, "rep_ms": 200, "min_reps": 10, "max_reps": 100,
                     "pin_host": False},
        "groups": [
            {"variants": SMALL_VARIANTS, "shapes": [[4, 2048]], "heads": [16], "head_dim": [128],
             "dtype": ["bfloat16"], "passes": ["train_step"]},
        ],
    },
}
PRESET_HELP = {
    "anchors": "the anchors grid: 7 variants × (B=4,S=4096),(B=1,S=16384), H=16, D=128, bf16, "
               "fwd and fwd_bwd, plus decode (B=8, Hq=32, Hkv=8, KV 8192/65536)",
    "anchors-d64": "the anchors grid at head dim 64",
    "decode": "the decode rows of the anchors grid: query length 1, B=8, Hq=32, Hkv=8, D=128, KV "
              "8192/65536, contiguous and paged caches",
    "tiny": "CPU-sized grid for CI: flexlab (interpreter) vs SDPA math, fp32 and bf16, with GQA",
    "small": "training shapes, unpinned: causal, alibi_causal, document × S 512-2048, D 64/128, B·H "
             "8-64, fwd and fwd_bwd; flexlab (eager and in torch.compile) vs torch flex compiled",
    "fp8": "the FP8 forward (float8_e4m3fn, per-head descales) beside bf16's forward: noop, causal, "
           "alibi_causal, sliding window × (B=4,S=4096),(B=1,S=16384), H=16, D=128",
    "train-step": "one compiled transformer block's forward+backward (B=4, S=2048, H=16, D=128, "
                  "d_model 2048), tokens/s: flexlab (eager attention, and in the graph) vs torch flex",
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def load_config(source: str | Path | dict) -> dict:
    """Return the config mapping of a preset name, a .toml/.yaml/.yml/.json file, or a dict.

    Raises:
        ConfigError: an unknown name, a missing file, or a file that does not parse (with the
            parser's line and reason).
    """
    if isinstance(source, dict):
        return source
    text = str(source)
    if text in PRESETS:
        return json.loads(json.dumps(PRESETS[text]))  # deep copy
    path = Path(text)
    if not path.is_file():
        raise ConfigError(f"--config {text!r} is neither a preset ({', '.join(preset_names())}) "
                          f"nor an existing file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python < 3.11
                try:
                    import tomli as tomllib
                except ModuleNotFoundError as exc:
                    raise ConfigError(f"reading {path} needs Python 3.11+ or the tomli package") from exc
            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ModuleNotFoundError as exc:
                raise ConfigError(f"reading {path} needs pyyaml (pip install pyyaml), or write the "
                                  "config as TOML") from exc
            with open(path) as f:
                data = yaml.safe_load(f)
        elif suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ConfigError(f"config file {path} must end in .toml, .yaml, .yml or .json")
    except ConfigError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"config file {path} does not parse as {suffix[1:].upper()}: "
                          f"{_one_line(exc)}") from None
    except Exception as exc:  # yaml.YAMLError has no common base with the others
        if type(exc).__module__.startswith("yaml"):
            raise ConfigError(f"config file {path} does not parse as YAML: {_one_line(exc)}") from None
        raise
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _as_list(value, what: str) -> list:
    if value is None:
        raise ConfigError(f"{what}: missing")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _norm_dtype(value) -> str:
    name = str(value).replace("torch.", "")
    name = _DTYPE_ALIASES.get(name, name)
    if not isinstance(value, str) or name not in DTYPES:
        raise ConfigError(f"dtype {value!r}: expected one of {DTYPES} (or fp32, bf16, fp16)")
    return name


def _norm_pass(value) -> str:
    name = _PASS_ALIASES.get(str(value), str(value))
    if not isinstance(value, str) or name not in PASSES:
        raise ConfigError(f"pass {value!r}: expected one of {list(PASSES)} "
                          "(or forward, forward+backward)")
    return name


def _int(value, what: str) -> int:
    """A positive int, exactly: 32.5, "32" and True are refused, never converted."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what}: {value!r} is not an integer")
    if value < 1:
        raise ConfigError(f"{what}: {value!r} must be a positive integer")
    return value


def _shapes(group: dict, where: str) -> list[tuple[int, int, int]]:
    if "shapes" in group:
        out = []
        for entry in _as_list(group["shapes"], f"{where}.shapes"):
            what = f"{where}.shapes entry {entry!r}"
            if isinstance(entry, dict):
                unknown = set(entry) - {"batch", "seq", "q_len", "kv_len"}
                if unknown or "batch" not in entry or not ({"seq", "q_len"} & set(entry)):
                    raise ConfigError(f"{what}: expected {{batch=, q_len= (or seq=), kv_len=}}")
                q = entry.get("q_len", entry.get("seq"))
                out.append((_int(entry["batch"], what), _int(q, what), _int(entry.get("kv_len", q), what)))
            elif isinstance(entry, (list, tuple)) and len(entry) in (2, 3):
                out.append((_int(entry[0], what), _int(entry[1], what), _int(entry[-1], what)))
            else:
                raise ConfigError(f"{what}: expected [batch, seq], [batch, q_len, kv_len] "
                                  "or {batch=, q_len=, kv_len=}")
        return out
    batches = [_int(b, f"{where}.batch") for b in _as_list(group.get("batch"), f"{where}.batch (or shapes)")]
    if "seq" in group:
        seqs = [(s, s) for s in (_int(v, f"{where}.seq") for v in _as_list(group["seq"], f"{where}.seq"))]
    else:
        qs = [_int(v, f"{where}.q_len") for v in _as_list(group.get("q_len"), f"{where}.q_len (or seq, or shapes)")]
        kvs = [_int(v, f"{where}.kv_len") for v in _as_list(group.get("kv_len", group.get("q_len")),
                                                             f"{where}.kv_len")]
        seqs = list(itertools.product(qs, kvs))
    return [(b, q, kv) for b in batches for q, kv in seqs]


def _pairs(values, what: str, words: str) -> list[tuple[int, int]]:
    out = []
    for entry in _as_list(values, what):
        if isinstance(entry, (list, tuple)):
            if len(entry) != 2:
                raise ConfigError(f"{what} entry {entry!r}: expected {words}")
            out.append((_int(entry[0], what), _int(entry[1], what)))
        else:
            try:
                value = _int(entry, what)
            except ConfigError:
                raise ConfigError(f"{what} entry {entry!r}: expected {words}") from None
            out.append((value, value))
    return out


def _heads(group: dict, where: str) -> list[tuple[int, int]]:
    """A group's (query heads, kv heads) pairs: ``heads`` × ``kv_heads``, or ``heads`` alone
    (an integer, or a [query heads, kv heads] pair)."""
    if "kv_heads" in group:
        return [(_int(h, f"{where}.heads"), _int(kv, f"{where}.kv_heads"))
                for h in _as_list(group.get("heads"), f"{where}.heads")
                for kv in _as_list(group["kv_heads"], f"{where}.kv_heads")]
    return _pairs(group.get("heads"), f"{where}.heads", "a positive integer or [query heads, kv heads]")


def _flag(key: str) -> str:
    """The command-line flag of an override key (``kv_heads`` -> ``--kv-heads``)."""
    return "--" + key.replace("_", "-")


_SHAPE_KEYS = ("batch", "seq", "q_len", "kv_len")


def _flag_ints(overrides: dict, key: str) -> list[int] | None:
    if key not in overrides:
        return None
    return [_int(v, _flag(key)) for v in _as_list(overrides[key], _flag(key))]


def _override_group(group: dict, overrides: dict, where: str) -> dict:
    """``group`` with the command line's ``overrides``. Each flag changes only the axis it names:
    ``--q-len`` keeps each shape's KV length, ``--kv-heads`` each pair's query heads, ``--batch``
    the lengths; a shape or head pair is replaced by one per value given."""
    g = {**group, **{k: v for k, v in overrides.items()
                     if k not in _SHAPE_KEYS and k not in ("heads", "kv_heads")}}
    if "shapes" in overrides:
        for k in _SHAPE_KEYS:
            g.pop(k, None)
    elif any(k in overrides for k in _SHAPE_KEYS):
        batches, seqs = _flag_ints(overrides, "batch"), _flag_ints(overrides, "seq")
        q_lens, kv_lens = _flag_ints(overrides, "q_len"), _flag_ints(overrides, "kv_len")
        new = []
        for b, q, kv in _shapes(group, where):
            lengths = [(s, s) for s in seqs] if seqs else [
                (q2, kv2) for q2 in (q_lens or [q]) for kv2 in (kv_lens or [kv])]
            new += [(b2, q2, kv2) for b2 in (batches or [b]) for q2, kv2 in lengths]
        for k in _SHAPE_KEYS:
            g.pop(k, None)
        g["shapes"] = [list(s) for s in dict.fromkeys(new)]
    if "heads" in overrides or "kv_heads" in overrides:
        q_heads = kv_heads = None
        if "kv_heads" not in overrides and any(isinstance(h, (list, tuple)) for h in
                                               _as_list(overrides["heads"], "--heads")):
            # [query heads, kv heads] pairs (the config's form) replace the group's pairs.
            pairs = _pairs(overrides["heads"], "--heads", "a positive integer or [query heads, kv heads]")
        else:
            q_heads, kv_heads = _flag_ints(overrides, "heads"), _flag_ints(overrides, "kv_heads")
            pairs = []
            for hq, hkv in _heads(group, where):
                for hq2 in q_heads or [hq]:
                    # A group without GQA stays without it when only --heads is given.
                    for hkv2 in kv_heads or ([hq2] if hq == hkv else [hkv]):
                        pairs.append((hq2, hkv2))
        for hq, hkv in pairs:
            if hq % hkv:
                flags = " and ".join(_flag(k) for k in ("heads", "kv_heads") if k in overrides)
                raise ConfigError(f"{flags}: {hq} query heads are not a multiple of {hkv} KV heads "
                                  f"(with {where}.heads {group.get('heads')!r}); give --heads and "
                                  "--kv-heads so that the query heads are a multiple of the KV heads")
        g.pop("kv_heads", None)
        g["heads"] = [list(p) for p in dict.fromkeys(pairs)]
    return g


_GROUP_KEYS = ("variants", "shapes", "batch", "seq", "q_len", "kv_len", "heads", "kv_heads",
               "head_dim", "dtype", "passes")


def expand_group(group: dict, where: str = "group") -> list[Case]:
    """The Cartesian product of one group's lists, as cases. ``where`` names the group in errors."""
    if not isinstance(group, dict):
        raise ConfigError(f"{where}: expected a mapping of {list(_GROUP_KEYS)}, got {group!r}")
    unknown = set(group) - set(_GROUP_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in {where}; known keys: {sorted(_GROUP_KEYS)}")
    variants = _as_list(group.get("variants"), f"{where}.variants")
    for v in variants:
        if not isinstance(v, str) or not v.strip():
            raise ConfigError(f"{where}.variants entry {v!r}: expected a variant spec (a string)")
    heads = _heads(group, where)
    dims = _pairs(group.get("head_dim"), f"{where}.head_dim", "a positive integer or [D, Dv]")
    dtypes = [_norm_dtype(d) for d in _as_list(group.get("dtype", ["bfloat16"]), f"{where}.dtype")]
    passes = [_norm_pass(p) for p in _as_list(group.get("passes", ["fwd"]), f"{where}.passes")]
    cases = []
    for variant, (b, q, kv), (hq, hkv), (d, dv), dtype, p in itertools.product(
            variants, _shapes(group, where), heads, dims, dtypes, passes):
        case = Case(variant.strip(), b, hq, hkv, q, kv, d, dv, dtype, p)
        case.validate()
        cases.append(case)
    return cases


_TOP_KEYS = ("name", "providers", "settings", "groups")


def check_device(text: str | None):
    """The torch.device of a ``--device`` value (None: CUDA when available, else the CPU).

    Raises:
        ConfigError: not cpu/cuda[:N], or a CUDA device this machine does not have.
    """
    import torch

    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {text!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {text!r}: no CUDA GPU on this machine (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {text!r}: this machine has {torch.cuda.device_count()} CUDA "
                              "device(s)")
    return device


def check_variants(cases: list[Case]) -> None:
    """Resolve every variant spec's names, parameters and files at each case shape it runs at,
    without building its mods. Raises :class:`bench.mods.VariantError` naming the spec."""
    from bench.mods import check_spec, shape_context

    seen = set()
    for c in cases:
        context = shape_context(c.batch, c.q_heads, c.kv_heads, c.q_len, c.kv_len, c.head_dim)
        key = (c.variant, tuple(sorted(context.items())))
        if key not in seen:
            seen.add(key)
            check_spec(c.variant, context)


def build_grid(config: dict, name: str = "grid", *, variants=None, passes=None, providers=None,
               dtypes=None, overrides: dict | None = None, settings: dict | None = None,
               validate_variants: bool = True) -> Grid:
    """Expand a config mapping into a :class:`Grid`, applying command-line filters and overrides.

    Every part is checked before anything runs (types, ranges, known providers, and, with
    ``validate_variants``, the variant specs): errors are :class:`ConfigError` or
    :class:`bench.mods.VariantError`, with one-line messages naming the key.

    Args:
        config: mapping with ``groups`` (or the keys of one group at the top level), ``providers``,
            ``settings``.
        variants, passes, providers, dtypes: keep only these (None keeps all). ``variants`` may
            name variants absent from the config: they replace the config's variants.
        overrides: group keys (``shapes``, ``heads``, ``head_dim``, ...) replacing every group's.
        settings: fields of :class:`Settings` overriding the config's.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"a config is a mapping, not {type(config).__name__}")
    config = dict(config)
    groups = config.pop("groups", None)
    listed = groups is not None
    if groups is None:
        group = {k: config.pop(k) for k in list(config) if k not in _TOP_KEYS}
        groups = [group]
    else:
        unknown = set(config) - set(_TOP_KEYS)
        if unknown:
            raise ConfigError(f"unknown top-level key(s) {sorted(unknown)}; known: {list(_TOP_KEYS)} "
                              "(group keys go inside [[groups]])")
        if not isinstance(groups, list) or not groups:
            raise ConfigError(f"groups: expected a non-empty list of groups, got {groups!r}")
    # An empty filter is a mistake (``--variants ""``), never "keep all": that would run the whole grid.
    for flag, given in (("--variants", variants), ("--passes", passes), ("--providers", providers),
                        ("--dtype", dtypes)):
        if given is not None and not list(given):
            raise ConfigError(f"{flag} is empty: give at least one value, or leave {flag} out to keep "
                              "the config's")
    name = config.get("name", name)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name={name!r}: expected a non-empty string")
    if overrides:
        if "seq" in overrides and ("q_len" in overrides or "kv_len" in overrides):
            raise ConfigError("--seq sets both lengths: give --seq alone, or --q-len and/or --kv-len")
        groups = [_override_group(g, overrides, f"groups[{i}]" if listed else "config")
                  if isinstance(g, dict) else g for i, g in enumerate(groups)]
    pass_filter = {_norm_pass(p) for p in passes} if passes else None
    dtype_filter = {_norm_dtype(d) for d in dtypes} if dtypes else None
    cases: list[Case] = []
    seen = set()
    for i, g in enumerate(groups):
        if variants and isinstance(g, dict):
            g = {**g, "variants": list(variants)}
        for case in expand_group(g, f"groups[{i}]" if listed else "config"):
            if pass_filter and case.pass_ not in pass_filter:
                continue
            if dtype_filter and case.dtype not in dtype_filter:
                continue
            if case.case_id not in seen:
                seen.add(case.case_id)
                cases.append(case)
    provider_list = list(providers) if providers else config.get("providers")
    if not provider_list:
        raise ConfigError("no providers: give them in the config ('providers = [...]') or with --providers")
    if not isinstance(provider_list, list) or not all(isinstance(p, str) for p in provider_list):
        raise ConfigError(f"providers={provider_list!r}: expected a list of provider names")
    from bench.providers import PROVIDERS

    unknown = [p for p in provider_list if p not in PROVIDERS]
    if unknown:
        raise ConfigError(f"unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
    raw = config.get("settings") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"settings: expected a mapping, got {raw!r}")
    fields = {f.name for f in dataclasses.fields(Settings)}
    merged = {**raw, **(settings or {})}
    unknown = set(merged) - fields
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(fields)}")
    settings_obj = Settings(**merged).validate()
    if validate_variants:
        check_variants(cases)
    return Grid(name=name, cases=cases, providers=provider_list, settings=settings_obj)
