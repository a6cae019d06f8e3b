"""Which kernel, path and launch mechanism serve a call: one frozen policy object passed in.

A :class:`DispatchPolicy` holds every rule that the kernels' host code reads to choose between the
Gluon kernels and the Triton templates, between the template's paths (dense, runs of full blocks,
finer tables, descriptors, warp specialization, one launch or two) and between launch mechanisms.
Its defaults are flexcore's choices; :class:`flexcore.KernelOptions` carries an override
(``KernelOptions(policy=...)``, for experiments and tests) and a ``backend`` that restricts the
kernels, and the kernels read the result of :func:`resolve` (``KernelOptions.dispatch``, computed
once per options object). The policy is part of the options, hence of every plan and cache key.

Three-way fields take ``"auto"`` (flexcore's rule), ``"on"`` or ``"off"``; each field's comment says
what "on" means for it. Sets of head dims or kinds are tuples, so that a policy's repr (which
flexcore.ops hashes into the keys of compiled calls) is the same in every process. docs/decisions.md records the measurements behind the rules.

Example:
    >>> from flexcore import KernelOptions
    >>> from flexcore.kernels.policy import DispatchPolicy, ForwardPolicy
    >>> opts = KernelOptions(policy=DispatchPolicy(forward=ForwardPolicy(refine="off")))
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from flexcore.errors import InputError
from flexcore.kernels.choice import TuneRule

Switch = Literal["auto", "on", "off"]
Backend = Literal["auto", "triton", "gluon"]
BACKENDS: tuple[str, ...] = get_args(Backend)
_SWITCHES = get_args(Switch)


def _check_fields(obj) -> None:
    """InputError naming the field where a value has the wrong kind (a typo would otherwise pick
    a path silently)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        where = f"{type(obj).__name__}.{f.name} = {value!r}"
        if kind == "Switch":
            if value not in _SWITCHES:
                raise InputError(f"{where}: expected one of {list(_SWITCHES)}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise InputError(f"{where}: expected True or False")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InputError(f"{where}: expected a number >= 0")
        elif kind.startswith("tuple"):
            if not isinstance(value, tuple):
                raise InputError(f"{where}: expected a tuple")
        elif kind.startswith("int | None"):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError(f"{where}: expected an int or None")
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{where}: expected an int >= 0")


@dataclass(frozen=True)
class ForwardPolicy:
    """The Triton forward template's paths (flexcore.kernels.forward)."""

    #: K/V tiles through tensor descriptors (TMA). auto: on Hopper or later for 2-byte dtypes with
    #: aligned rows, in calls of at least tma_min_flops dense-equivalent FLOPs (below it the
    #: descriptors' host time outweighs their few percent of kernel time); on: wherever the layout
    #: allows, also without those checks; off: never.
    tma: Switch = "auto"
    tma_min_flops: float = 5e10
    #: K and V through descriptors made on the host over all their rows. auto: at kv_rows_head_dims;
    #: on: at every head dim where the layout allows; off: never.
    kv_rows: Switch = "auto"
    kv_rows_head_dims: tuple[int, ...] = (128,)
    #: Masks whose blocks are all full skip the tables (the dense path).
    dense: bool = True
    #: Warp-specialized candidates on the dense path, where K/V go through descriptors (tma). auto:
    #: autotuned in beside the others; on: the dense path takes only them (also under the
    #: interpreter, which runs the loop unspecialized); off: never.
    warp_spec: Switch = "auto"
    #: Full blocks that form one run per row are stepped over without reading their indices.
    full_runs: bool = True
    #: Launch order: None natural; G: longest row first within groups of G mask rows (all rows if
    #: G <= 0), for rows that differ in length and visit schedule_min_blocks blocks on average.
    schedule_group: int | None = 256
    schedule_min_blocks: float = 8.0
    #: Finer (64x64) tables where a mask's partial blocks hide empty and full sub-blocks. auto: where
    #: their cost is at most refine_max_cost of the mask's own and the Gluon masked kernel does not
    #: serve the call (refine_skew); on: wherever the tables divide; off: never.
    refine: Switch = "auto"
    refine_max_cost: float = 0.95
    #: The Gluon masked kernel keeps the mask's own tables unless its longest row costs more than
    #: refine_skew times the mean.
    refine_skew: float = 2.0

    def __post_init__(self):
        _check_fields(self)


@dataclass(frozen=True)
class BackwardPolicy:
    """The Triton backward template's paths (flexcore.kernels.backward)."""

    #: Q/dO and K/V tiles through tensor descriptors. auto: by the GPU and the layout; on: wherever
    #: the layout allows; off (default): pointer loads, as fast within noise.
    tma: Switch = "off"
    #: Runs of full blocks stepped over from their first index, at head dims up to
    #: full_runs_max_head_dim (larger ones only with a score_mod).
    full_runs: bool = True
    full_runs_max_head_dim: int = 64
    #: 16-bit inputs recompute probabilities as exp2(s - lse2): one product less per score.
    p_from_lse: bool = True
    #: The dense path for all-full masks. auto: at dense_head_dims (with a score_mod only
    #: warp-specialized); on: for every all-full mask; off: never.
    dense: Switch = "auto"
    dense_head_dims: tuple[int, ...] = (128,)
    #: Warp-specialized dense loops. auto: at dense_head_dims with a score_mod on Hopper or later;
    #: on: wherever the layout allows (also under the interpreter); off (default): never, as the
    #: gain is a few percent (docs/decisions.md#backward-dense-path).
    warp_spec: Switch = "off"
    #: The kinds of program whose loops are specialized: one of them. Both at once gave gradients
    #: that differ from run to run on the GPU (a race), so that is refused.
    warp_spec_kinds: tuple[str, ...] = ("dkdv",)
    #: Where captured tensors or sinks want gradients, delta is recomputed as rowsum(P * dP): by an
    #: extra pass where captured tensors do (their dS reads it), else by the dQ programs beside dQ
    #: (by that pass alone where only sinks learn).
    exact_delta: bool = True
    #: One launch for the dK/dV and dQ programs. auto: timed against two at fused_head_dims (the
    #: first backward of each kernel and size); on/off: forced (out of shared memory splits anyway).
    fused: Switch = "auto"
    fused_head_dims: tuple[int, ...] = (128,)

    def __post_init__(self):
        _check_fields(self)
        if len(self.warp_spec_kinds) != 1 or self.warp_spec_kinds[0] not in ("dkdv", "dq"):
            raise InputError(f"BackwardPolicy.warp_spec_kinds = {self.warp_spec_kinds!r}: expected ('dkdv',) or "
                             "('dq',); specializing both kinds at once races on the GPU "
                             "(docs/decisions.md#backward-dense-path)")


@dataclass(frozen=True)
class GluonPolicy:
    """The Gluon kernels for Hopper (flexcore.kernels.hopper). For each kernel, auto: wherever it
    applies by its rule; on: also ignoring the rule's thresholds, and a call it cannot serve raises
    instead of falling back to the Triton template; off: never."""

    dense: Switch = "auto"
    masked: Switch = "auto"
    backward: Switch = "auto"
    #: Least dense-equivalent FLOPs (flexcore.kernels.forward.dense_flops) of a masked call for the
    #: masked forward and the backward: below it they take longer per call than the template.
    masked_min_flops: float = 2e11
    #: Least key blocks per mask row, on average, for the two-warpgroup masked forward.
    masked_min_mean_blocks: float = 8.0
    #: The same for the three-warpgroup masked forward (head dim 64).
    union_min_mean_blocks: float = 12.0
    #: Most fraction of a 192-row program's tiles that only one of its two mask blocks lists.
    union_max_exclusive: float = 0.15
    #: At head dim 64 the masked forward yields to the template over finer tables where those are
    #: taken.
    union_yields: bool = True
    #: Least blocks per row, on average, of the mask and its transpose for the masked backward.
    backward_min_mean_blocks: float = 8.0

    def __post_init__(self):
        _check_fields(self)


@dataclass(frozen=True)
class LaunchPolicy:
    """How compiled kernels are launched (flexcore.kernels.launch)."""

    #: Launch a kernel seen before through its compiled launcher directly (False: through triton's
    #: JITFunction.run every time).
    direct: bool = True
    #: Keep per-call plans of repeated calls (False: every call decides again).
    plans: bool = True
    #: Threads that compile an autotuner's configurations; None: $FLEXLAB_COMPILE_THREADS, else the
    #: host's cores up to 8; 0 or 1: one at a time.
    compile_threads: int | None = None
    #: How timed candidates are compared and remembered (repetitions, tie rule, plan cache).
    tune: TuneRule = TuneRule()
    #: Under torch.compile on CUDA, the forward as an op that Inductor launches itself (the Triton
    #: template with decisions from shapes alone; flexcore.ops.inline_forward says where it
    #: applies). auto: 16-bit calls whose dense-equivalent work is at most inline_max_flops, where
    #: the host's time per call outweighs the kernel choice; on: every call it applies to (float32
    #: too); off: never (every call through flexcore's own dispatch).
    inline: Switch = "auto"
    inline_max_flops: float = 3e11
    #: The backward of an inline forward likewise (flexcore.ops.inline_backward_call): auto: the
    #: calls whose forward the ``inline`` rule takes; on: every call the inline forward applies to;
    #: off: flexcore's backward op (docs/decisions.md#compiled-host-path).
    inline_backward: Switch = "auto"

    def __post_init__(self):
        _check_fields(self)


@dataclass(frozen=True)
class DispatchPolicy:
    """Every dispatch rule of flexcore's kernels, by family. Hashable and compared by value; its
    hash is computed once (it is part of per-call cache keys)."""

    forward: ForwardPolicy = ForwardPolicy()
    backward: BackwardPolicy = BackwardPolicy()
    gluon: GluonPolicy = GluonPolicy()
    launch: LaunchPolicy = LaunchPolicy()

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value).__name__ != f.type:
                raise InputError(f"DispatchPolicy.{f.name} = {value!r}: expected a {f.type}")
        object.__setattr__(self, "_hash", hash((self.forward, self.backward, self.gluon, self.launch)))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self):  # str hashes differ between processes: the cached hash is not pickled
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def replace(self, **families) -> "DispatchPolicy":
        """A copy with some fields of some families changed: ``replace(forward={"refine": "on"})``."""
        changed = {}
        for name, fields in families.items():
            if name not in {f.name for f in dataclasses.fields(self)}:
                raise InputError(f"DispatchPolicy has no family {name!r}; families: "
                                 f"{[f.name for f in dataclasses.fields(self)]}")
            changed[name] = dataclasses.replace(getattr(self, name), **fields)
        return dataclasses.replace(self, **changed)


DEFAULT_POLICY = DispatchPolicy()


def resolve(backend: str, policy: DispatchPolicy | None) -> DispatchPolicy:
    """The policy the kernels read: ``policy`` (the defaults for None) with ``backend`` applied.
    "triton" turns the Gluon kernels off; "gluon" turns them on (a call they cannot serve raises)
    and needs a Hopper GPU with triton's Gluon. InputError where the two contradict or the machine
    has no Gluon."""
    policy = DEFAULT_POLICY if policy is None else policy
    if backend == "auto":
        return policy
    wanted = "off" if backend == "triton" else "on"
    gluon = policy.gluon
    for name in ("dense", "masked", "backward"):
        if getattr(gluon, name) not in ("auto", wanted):
            raise InputError(f"kernel_options backend={backend!r} contradicts policy.gluon.{name}="
                             f"{getattr(gluon, name)!r}; leave one of them at its default")
    if backend == "gluon":
        from flexcore.kernels.hopper import gluon_unavailable

        reason = gluon_unavailable()
        if reason is not None:
            raise InputError(f"kernel_options backend='gluon' needs an sm_90 (Hopper) GPU and a triton "
                             f"with Gluon's Hopper API: {reason}. Valid backends here: 'auto' or "
                             f"'triton'")
    return policy.replace(gluon=dict(dense=wanted, masked=wanted, backward=wanted))


def fp8_policy(policy: DispatchPolicy) -> DispatchPolicy:
    """The policy of a float8_e4m3fn call (the policy the kernels read, ``KernelOptions.dispatch``).

    - The Gluon forwards serve FP8 (head dim 128) only where forced ("on", or backend="gluon"):
      "auto" becomes "off", because the Triton template's FP8 path measured as fast or faster
      (docs/decisions.md#fp8-forward).
    - ``forward.kv_rows`` and ``forward.warp_spec`` are off: both read V row-major through one
      descriptor over all rows, and FP8 reads V key-major.
    """
    gluon = policy.gluon
    return policy.replace(gluon=dict(dense="on" if gluon.dense == "on" else "off",
                                     masked="on" if gluon.masked == "on" else "off"),
                          forward=dict(kv_rows="off", warp_spec="off"))
