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
    passes = ["fwd", "fwd_bwd"]           # and/or "decode"

Each group is the Cartesian product of its lists; the grid is the union of its groups.
Variant specs are described in :mod:`bench.mods`.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from bench.flops import PASS_FACTORS

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
_PASS_ALIASES = {"forward": "fwd", "forward+backward": "fwd_bwd", "fwd+bwd": "fwd_bwd",
                 "backward": "fwd_bwd", "bwd": "fwd_bwd"}


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
        if self.pass_ not in PASS_FACTORS:
            raise ConfigError(f"pass={self.pass_!r} in case {self.case_id}: expected one of "
                              f"{sorted(PASS_FACTORS)}")


@dataclass
class Settings:
    """How cases are measured (see bench/NOTES.md for the trade-offs)."""

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
    #: time per call halves and spreads less (bench/NOTES.md entry 52)
    pin_host: bool = True

    def graph_passes(self) -> set[str]:
        """The passes in :attr:`cuda_graphs` ("all" means every pass). Raises ConfigError for a
        name that is not a pass."""
        names = {p.strip() for p in str(self.cuda_graphs).split(",") if p.strip()}
        if names - set(PASS_FACTORS) - {"all", "none"}:
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r}: expected comma-separated passes from "
                              f"{sorted(PASS_FACTORS)}, 'all' or 'none'")
        return set(PASS_FACTORS) if "all" in names else names - {"none"}


@dataclass
class Grid:
    name: str
    cases: list[Case]
    providers: list[str]
    settings: Settings = field(default_factory=Settings)

    def to_dict(self) -> dict:
        return {"name": self.name, "providers": list(self.providers),
                "settings": dataclasses.asdict(self.settings),
                "cases": [dataclasses.asdict(c) for c in self.cases]}


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
ANCHOR_PROVIDERS = ["flexlab", "torch_flex", "torch_flex_flash", "flash_attn", "sdpa_cudnn",
                    "sdpa_flash", "flexlab_paged"]
_ANCHOR_DECODE = {
    "variants": ["noop", "alibi", "sliding_window(window_size=1024)"],
    "shapes": [[8, 1, 8192], [8, 1, 65536]], "heads": [[32, 8]], "head_dim": [128],
    "dtype": ["bfloat16"], "passes": ["decode"],
}


def _anchors(head_dims: list[int]) -> dict:
    return {
        "providers": ANCHOR_PROVIDERS,
        "settings": {"warmup_ms": 25, "rep_ms": 100, "min_reps": 10, "max_reps": 100,
                     "ref_slices": 1},
        "groups": [
            {"variants": ANCHOR_VARIANTS, "shapes": [[4, 4096], [1, 16384]], "heads": [16],
             "head_dim": head_dims, "dtype": ["bfloat16"], "passes": ["fwd", "fwd_bwd"]},
            _ANCHOR_DECODE,
        ],
    }


PRESETS: dict[str, dict] = {
    # The ANCHORS.md grid (bf16, D=128, H=16, 16k tokens per batch) and its decode rows.
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
            # GQA (4 query heads on 2 KV heads) in both dtypes.
            {"variants": ["causal", "alibi_causal", "sliding_window(window_size=48)"],
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
}
PRESET_HELP = {
    "anchors": "ANCHORS.md grid: 7 variants × (B=4,S=4096),(B=1,S=16384), H=16, D=128, bf16, "
               "fwd and fwd_bwd, plus decode (B=8, Hq=32, Hkv=8, KV 8192/65536)",
    "anchors-d64": "the anchors grid at head dim 64",
    "decode": "the decode rows of the anchors grid: query length 1, B=8, Hq=32, Hkv=8, D=128, KV "
              "8192/65536, contiguous and paged caches",
    "tiny": "CPU-sized grid for CI: flexlab (interpreter) vs SDPA math, fp32 and bf16, with GQA",
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def load_config(source: str | Path | dict) -> dict:
    """Return the config mapping of a preset name, a .toml/.yaml/.yml/.json file, or a dict."""
    if isinstance(source, dict):
        return source
    text = str(source)
    if text in PRESETS:
        return json.loads(json.dumps(PRESETS[text]))  # deep copy
    path = Path(text)
    if not path.exists():
        raise ConfigError(f"--config {text!r} is neither a preset ({', '.join(preset_names())}) "
                          f"nor an existing file")
    suffix = path.suffix.lower()
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
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _as_list(value, what: str) -> list:
    if value is None:
        raise ConfigError(f"group is missing {what!r}")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _norm_dtype(value) -> str:
    name = str(value).replace("torch.", "")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ConfigError(f"dtype {value!r}: expected one of {DTYPES} (or fp32, bf16, fp16)")
    return name


def _norm_pass(value) -> str:
    name = _PASS_ALIASES.get(str(value), str(value))
    if name not in PASS_FACTORS:
        raise ConfigError(f"pass {value!r}: expected one of {sorted(PASS_FACTORS)} "
                          "(or forward, forward+backward)")
    return name


def _shapes(group: dict) -> list[tuple[int, int, int]]:
    if "shapes" in group:
        out = []
        for entry in _as_list(group["shapes"], "shapes"):
            if isinstance(entry, dict):
                q = entry.get("q_len", entry.get("seq"))
                out.append((entry["batch"], q, entry.get("kv_len", q)))
            elif isinstance(entry, (list, tuple)) and len(entry) in (2, 3):
                out.append((entry[0], entry[1], entry[-1]))
            else:
                raise ConfigError(f"shape {entry!r}: expected [batch, seq], [batch, q_len, kv_len] "
                                  "or {batch=, q_len=, kv_len=}")
        return out
    batches = _as_list(group.get("batch"), "batch (or shapes)")
    if "seq" in group:
        seqs = [(s, s) for s in _as_list(group["seq"], "seq")]
    else:
        seqs = list(itertools.product(_as_list(group.get("q_len"), "q_len (or seq, or shapes)"),
                                      _as_list(group.get("kv_len", group.get("q_len")), "kv_len")))
    return [(b, q, kv) for b in batches for q, kv in seqs]


def _pairs(values, what: str) -> list[tuple[int, int]]:
    out = []
    for entry in _as_list(values, what):
        if isinstance(entry, (list, tuple)):
            if len(entry) != 2:
                raise ConfigError(f"{what} entry {entry!r}: expected a number or a pair of numbers")
            out.append((int(entry[0]), int(entry[1])))
        else:
            out.append((int(entry), int(entry)))
    return out


def expand_group(group: dict) -> list[Case]:
    """The Cartesian product of one group's lists, as cases."""
    known = {"variants", "shapes", "batch", "seq", "q_len", "kv_len", "heads", "kv_heads",
             "head_dim", "dtype", "passes"}
    unknown = set(group) - known
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in a grid group; known keys: {sorted(known)}")
    variants = [str(v) for v in _as_list(group.get("variants"), "variants")]
    if "kv_heads" in group:
        heads = [(h, kv) for h in _as_list(group.get("heads"), "heads") for kv in _as_list(group["kv_heads"], "kv_heads")]
        heads = [(int(h), int(kv)) for h, kv in heads]
    else:
        heads = _pairs(group.get("heads"), "heads")
    dims = _pairs(group.get("head_dim"), "head_dim")
    dtypes = [_norm_dtype(d) for d in _as_list(group.get("dtype", ["bfloat16"]), "dtype")]
    passes = [_norm_pass(p) for p in _as_list(group.get("passes", ["fwd"]), "passes")]
    cases = []
    for variant, (b, q, kv), (hq, hkv), (d, dv), dtype, p in itertools.product(
            variants, _shapes(group), heads, dims, dtypes, passes):
        case = Case(variant, int(b), hq, hkv, int(q), int(kv), d, dv, dtype, p)
        case.validate()
        cases.append(case)
    return cases


def build_grid(config: dict, name: str = "grid", *, variants=None, passes=None, providers=None,
               dtypes=None, overrides: dict | None = None, settings: dict | None = None) -> Grid:
    """Expand a config mapping into a :class:`Grid`, applying command-line filters and overrides.

    Args:
        config: mapping with ``groups`` (or the keys of one group at the top level), ``providers``,
            ``settings``.
        variants, passes, providers, dtypes: keep only these (None keeps all). ``variants`` may
            name variants absent from the config: they replace the config's variants.
        overrides: group keys (``shapes``, ``heads``, ``head_dim``, ...) replacing every group's.
        settings: fields of :class:`Settings` overriding the config's.
    """
    config = dict(config)
    groups = config.pop("groups", None)
    if groups is None:
        group = {k: config.pop(k) for k in list(config) if k not in ("name", "providers", "settings")}
        groups = [group]
    name = str(config.get("name", name))
    if overrides:
        groups = [{**g, **overrides} for g in groups]
        for g in groups:
            # Flags that give batch/seq replace a group's shapes, and the reverse.
            if "shapes" in overrides:
                for k in ("batch", "seq", "q_len", "kv_len"):
                    g.pop(k, None)
            elif any(k in overrides for k in ("batch", "seq", "q_len", "kv_len")):
                if "shapes" in g:
                    old = _shapes(g)
                    g.pop("shapes")
                    g.setdefault("batch", sorted({b for b, _, _ in old}))
                    if not any(k in g for k in ("seq", "q_len")):
                        g["q_len"] = sorted({q for _, q, _ in old})
                        g["kv_len"] = sorted({kv for _, _, kv in old})
    cases: list[Case] = []
    seen = set()
    for g in groups:
        if variants:
            g = {**g, "variants": list(variants)}
        for case in expand_group(g):
            if passes and case.pass_ not in {_norm_pass(p) for p in passes}:
                continue
            if dtypes and case.dtype not in {_norm_dtype(d) for d in dtypes}:
                continue
            if case.case_id not in seen:
                seen.add(case.case_id)
                cases.append(case)
    provider_list = list(providers) if providers else list(config.get("providers") or [])
    if not provider_list:
        raise ConfigError("no providers: give them in the config ('providers = [...]') or with --providers")
    fields = {f.name for f in dataclasses.fields(Settings)}
    merged = {**(config.get("settings") or {}), **(settings or {})}
    unknown = set(merged) - fields
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(fields)}")
    settings_obj = Settings(**merged)
    settings_obj.graph_passes()  # a bad cuda_graphs value fails here, before anything runs
    if not isinstance(settings_obj.pin_host, bool):
        raise ConfigError(f"pin_host={settings_obj.pin_host!r}: expected true or false")
    return Grid(name=name, cases=cases, providers=provider_list, settings=settings_obj)
