"""FlexDeMo's hyperparameters: one dataclass, one validation, shared by the optimizer and the Trainer.

The same names work as keyword arguments of :class:`hf_flexdemo.FlexDeMo` and as keys of
``TrainingArguments(optim_args="topk=32,chunk=64,scheme=demo")``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .compression import DECODE_MODES, VALUE_BITS
from .kernels import KERNELS, MAX_TILE_SIDE
from .kernels import check_settings as check_kernel_settings
from .scheme_traits import SchemeTraits, scheme_names, schemes_where, traits_of

NS_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "float32": torch.float32}
"""Newton-Schulz's arithmetic (update='orthogonal'); ``auto`` picks one by device
(:func:`hf_flexdemo.updates.orthogonal.newton_schulz_dtype`)."""
NS_DTYPE_CHOICES = ("auto", *NS_DTYPES)
NS_STEP_CHOICES = (3, 4, 5)
"""``ns_steps``: Newton-Schulz iterations (5: Muon's; 3 and 4: quintics fitted per iteration)."""

VALUE_DTYPES: dict[str, torch.dtype | None] = {
    "param": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
REPLAY_STEPS_DEFAULT = 32
"""Under torchft: enough for a node the others keep waiting for to sit out a few seconds and come back by replay."""
STALL_WAIT_DEFAULT = 5.0
JOIN_QUORUM = ("before_forward", "when_ready")
JOIN_QUORUM_DEFAULT = "when_ready"
"""Under torchft: a slow node is left out of the steps it is late for instead of holding every quorum."""
INDEX_CODINGS = ("fixed", "elias_fano")


def _packed(topk: int, value_bits: int) -> dict[str, Any]:
    """A preset's knobs: the indices in Elias-Fano code, which sends the same indices in fewer bits."""
    return {"topk": topk, "value_bits": value_bits, "pack_indices": True, "index_coding": "elias_fano"}


WIRE_PRESETS: dict[str, dict[str, Any]] = {
    "demo": {"topk": 32, "value_bits": 0, "pack_indices": False, "index_coding": "fixed"},
    "top128_4bit": _packed(128, 4),  # 4x DeMo's coefficients in 0.94x its bytes
    "top96_2bit": _packed(96, 2),
    "2bit": _packed(32, 2),
    # 1 coefficient in 114 (2bit: 1 in 128) on 128 x 128 tiles, every tile at that share (scale_topk): 1.03x
    # 2bit's bytes on OLMo2-1B, each tile's top-k drawn over 4x the area with one scale
    "top144_c128_2bit": _packed(144, 2) | {"chunk": 128, "scale_topk": True},
    "top24_2bit": _packed(24, 2),
    "top16_2bit": _packed(16, 2),
    "top4_1bit": {"topk": 4, "value_bits": 1, "pack_indices": True, "index_coding": "fixed"},  # no gain at 4
}
"""``wire=NAME``: the measured wire formats, from DeMo's own (fp32 values, 16-bit indices) to the most compressed.
Their bytes and loss: docs/update-rules.md, "Choosing a wire format"."""
WIRE_KNOBS = "topk, value_bits, pack_indices and index_coding"
"""What every preset sets; a preset on larger tiles also sets ``chunk`` and ``scale_topk``."""


def preset_knobs(name: str) -> str:
    """``"topk, value_bits, pack_indices and index_coding"``: the settings ``wire=name`` sets, for a message."""
    keys = list(WIRE_PRESETS[name])
    return f"{', '.join(keys[:-1])} and {keys[-1]}"


ROUNDINGS = ("nearest", "stochastic")
UPDATE_RULES = ("sign", "adam", "orthogonal")
"""How the decoded update becomes a parameter step (:mod:`hf_flexdemo.updates`)."""
DEFAULT_UPDATE, DEFAULT_ELEMENTWISE_UPDATE = "orthogonal", "adam"
"""The rule where it applies: it won against AdamW-HSDP on every preset of the quality study (BENCHMARKS.md)."""
FAULT_TOLERANCE = ("off", "torchft")

GROUP_KEYS = ("lr", "weight_decay", "decay", "topk", "chunk", "sign", "update", "betas", "eps")
"""Hyperparameters that may differ between parameter groups; the rest hold for the whole optimizer."""

SHARED_KEYS = ("lr", "weight_decay", "betas", "eps")
"""Hyperparameters other optimizers take as well (from ``TrainingArguments``)."""


DEFAULT_DECAY = 0.999
"""``decay`` when it is not given (DeMo's)."""


@dataclass(kw_only=True)
class RuleSettings:
    """The step: the momentum, and how the decoded update becomes a parameter step."""

    lr: float = field(default=1e-3, metadata={"help": "Step size (update='sign': each entry moves by lr)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay: p *= 1 - lr * wd."})
    decay: float | None = field(
        default=None,
        metadata={
            "help": f"Momentum decay beta: m = beta * m + lr * grad. None: {DEFAULT_DECAY}. diloco and sparseloco "
            "refuse it: their inner momentum is betas[0], their outer one outer_momentum."
        },
    )
    sign: bool = field(default=True, metadata={"help": "update='sign': apply the sign of the decoded update."})
    update: str | None = field(
        default=None,
        metadata={
            "help": "How the decoded update becomes a step: 'orthogonal' (Newton-Schulz per 2-D matrix, as Muon; "
            "other tensors take elementwise_update), 'adam' (divided by a running RMS of itself per entry, "
            "beta2 = betas[1], eps) or 'sign' (DeMo). None: 'orthogonal' where it applies (demo, lowrank, full, none), "
            "'sign' on random and striding and with sign=False. diloco and sparseloco: the inner step, AdamW when "
            "unset, or 'orthogonal' for Muon's on the matrices (the replica's own momentum, orthogonalized)."
        },
    )
    elementwise_update: str | None = field(
        default=None,
        metadata={
            "help": "update='orthogonal': the rule of what it does not orthogonalize (norms, biases, embeddings, "
            "heads), 'adam' (None: the default, as Muon leaves them to AdamW) or 'sign' ('adam' only on diloco and "
            "sparseloco: their inner AdamW)."
        },
    )
    ns_dtype: str = field(
        default="auto",
        metadata={
            "help": "update='orthogonal': dtype of the Newton-Schulz iteration. 'auto' (default): bf16 where every "
            "replica's device multiplies bf16 fast (a CUDA GPU of compute capability 8.0 or newer; a CPU with AVX-512 "
            "BF16 or AMX), float32 elsewhere (a CPU without them emulates bf16: 2.4x slower than float32 with AVX-512, "
            "about 16x with AVX2 only). 'bf16' (as Muon) or 'float32' forces one. The update is normalised in float32 "
            "first, so tiny updates stay exact in scale."
        },
    )
    ns_steps: int | None = field(
        default=None,
        metadata={
            "help": "update='orthogonal': Newton-Schulz iterations per step. None (default): Muon's five, one quintic "
            "five times. 4 or 3: fewer products (a fifth or two fifths fewer), each iteration with its own quintic, "
            "fitted to what the ones before it leave; a rougher orthogonalization (it lost loss on two of three "
            "presets, see docs/update-rules.md)."
        },
    )
    betas: tuple[float, float] = field(
        default=(0.9, 0.999),
        metadata={
            "help": "diloco, sparseloco: inner AdamW betas (with update='orthogonal', betas[0] is also the matrices' "
            "inner momentum); update='adam': beta2."
        },
    )
    eps: float = field(
        default=1e-8, metadata={"help": "diloco, sparseloco: inner AdamW epsilon; update='adam': its epsilon."}
    )

    def _check_rule(self) -> None:
        """Once ``update`` is resolved (:meth:`FlexDeMoConfig._resolve_rules`): Newton-Schulz's settings need its
        rule."""
        _check_choice("ns_dtype", self.ns_dtype, NS_DTYPE_CHOICES)
        if self.ns_steps is not None:
            _check_choice("ns_steps", self.ns_steps, NS_STEP_CHOICES)
        for name in ("ns_dtype", "ns_steps"):
            value = getattr(self, name)
            if value not in (None, "auto") and self.update != "orthogonal":  # it would be ignored
                raise ValueError(
                    f"FlexDeMo: {name}={value!r} applies to update='orthogonal' (its Newton-Schulz iteration), but "
                    f"update is {self.update!r}; drop {name}, or set update='orthogonal'."
                )


@dataclass(kw_only=True)
class ReplicationSettings:
    """The exchange: which scheme, what it sends of the momentum, and when."""

    scheme: str = field(
        default="demo",
        metadata={
            "help": "Replication scheme: 'demo' (the default), 'lowrank', 'random', 'striding', 'diloco', "
            "'sparseloco', 'full' or 'none'."
        },
    )
    topk: int = field(default=32, metadata={"help": "DCT coefficients sent per tile (demo)."})
    chunk: int = field(default=64, metadata={"help": "Largest tile side of the chunked DCT (demo)."})
    scale_topk: bool = field(
        default=False,
        metadata={
            "help": "demo, sparseloco: a tile smaller than chunk x chunk (a side that chunk does not divide, an "
            "FSDP shard's, a 1-D tensor's) keeps topk x its area / (chunk x chunk) coefficients, at least 1, "
            "instead of topk: every tile sends about the same share, so the bytes roughly follow the parameter "
            "count whatever the model's sides. Off: topk per tile (at most the tile)."
        },
    )
    topk_block: int = field(
        default=1,
        metadata={
            "help": "demo, sparseloco: pick the top-k in square blocks of topk_block x topk_block coefficients "
            "(entries for sparseloco), the blocks of the largest energy, every coefficient in them: one index "
            "travels per block instead of per coefficient. topk still counts coefficients and must be a multiple "
            "of topk_block**2. A tile side that topk_block does not divide (a 1-D tensor's) takes blocks of 1 along "
            "it. 1: each coefficient on its own (DeMo's top-k)."
        },
    )
    decode: str = field(
        default="selected",
        metadata={"help": "demo: average a coefficient over the replicas that sent it ('selected') or all ('mean')."},
    )
    replicate_every: int = field(
        default=1, metadata={"help": "Per-step schemes: replicate every N optimizer steps, accumulate in between."}
    )
    rate: float = field(
        default=1 / 128, metadata={"help": "random/striding: fraction of momentum entries sent per replication."}
    )
    seed: int = field(default=0, metadata={"help": "random: seed shared by all replicas to pick the same entries."})
    inner_steps: int = field(
        default=100, metadata={"help": "diloco, sparseloco: H, the local steps between outer steps."}
    )
    outer_lr: float = field(
        default=0.7,
        metadata={"help": "diloco: lr of the outer Nesterov SGD; sparseloco: of the outer step."},
    )
    outer_momentum: float = field(
        default=0.9,
        metadata={"help": "diloco: momentum of the outer Nesterov SGD; sparseloco: decay of the error feedback."},
    )
    overlap: bool = field(
        default=False,
        metadata={"help": "Per-step schemes: apply each step's exchange one step late, hiding it behind compute."},
    )
    shared_indices: bool = field(
        default=False,
        metadata={
            "help": "demo: every replica sends its coefficients at one index set, picked by each replica in turn "
            "one step ahead, in an all-reduce: bytes per node stay flat as nodes are added (float32 on the wire, "
            "float64 for float64 parameters)."
        },
    )
    derived_topk: int | None = field(
        default=None,
        metadata={
            "help": "demo: also send each tile's coefficients at this many positions that every replica derives "
            "alike (where the decoded updates have been largest lately), as values without indices, in value_bits "
            "codes or value_dtype; topk then picks the per-replica top-k outside them, with indices. Unset: DeMo's "
            "top-k alone."
        },
    )
    factor_rank: int | None = field(
        default=None,
        metadata={
            "help": "lowrank: the rank of the factors each matrix sends (one side a step, in a basis every replica "
            "shares; at most the matrix's smaller side). Unset: 1."
        },
    )

    def _check_replication(self) -> None:
        _check_choice("scheme", self.scheme, scheme_names())
        _check_choice("decode", self.decode, DECODE_MODES)
        _check_int("replicate_every", self.replicate_every, low=1)
        _check_int("topk_block", self.topk_block, low=1)
        for name in ("overlap", "shared_indices", "scale_topk"):
            _check_bool(name, getattr(self, name))
        _check_float("rate", self.rate, low=0.0, high=1.0, low_open=True)
        _check_int("seed", self.seed, low=0)
        _check_int("inner_steps", self.inner_steps, low=1)
        _check_float("outer_lr", self.outer_lr, low=0.0)
        _check_float("outer_momentum", self.outer_momentum, low=0.0, high=1.0, high_open=True)
        if self.derived_topk is not None:
            _check_int("derived_topk", self.derived_topk, low=1)
        if self.factor_rank is not None:
            _check_int("factor_rank", self.factor_rank, low=1)

    @property
    def traits(self) -> SchemeTraits:
        """What the scheme supports (declared on its class, :mod:`hf_flexdemo.scheme_traits`)."""
        return traits_of(self.scheme)


@dataclass(kw_only=True)
class WireSettings:
    """The wire: how what a scheme sends is written in bytes."""

    wire: str | None = field(
        default=None,
        metadata={
            "help": f"demo: a measured wire format by name, one of {sorted(WIRE_PRESETS)}; it sets {WIRE_KNOBS}, "
            "top144_c128_2bit also chunk=128 and scale_topk=True (a knob also given must agree with it). Unset: the "
            "knobs as given."
        },
    )
    value_dtype: str = field(
        default="param", metadata={"help": "dtype of values on the wire: 'param', 'bf16', 'fp16' or 'fp32'."}
    )
    value_bits: int = field(
        default=0,
        metadata={
            "help": "demo, sparseloco, lowrank: 0 sends values in value_dtype; 1 their signs and each tile's (lowrank: "
            "factor column's) mean magnitude; 2, 4 or 8 a symmetric integer code per value and one float32 scale "
            "per tile (column). The "
            "rounding error stays in the momentum (error feedback)."
        },
    )
    rounding: str = field(
        default="nearest",
        metadata={"help": "value_bits 2, 4, 8: 'nearest' or 'stochastic' (unbiased) rounding."},
    )
    pack_indices: bool = field(
        default=False,
        metadata={
            "help": "demo, sparseloco: send each index in the bits a tile position needs (12 for 64x64), not 16."
        },
    )
    index_coding: str = field(
        default="fixed",
        metadata={
            "help": "demo, sparseloco, with pack_indices=True: 'fixed' gives every index the same bits; "
            "'elias_fano' codes each tile's ascending indices in at most 2 + log2(tile / topk) bits each (9 for "
            "top 32 of 64x64, 7.3 for top 96): the same indices, fewer bytes."
        },
    )

    def _check_wire(self) -> None:
        """Once a ``wire`` preset has set its knobs (:meth:`FlexDeMoConfig._apply_wire_preset`)."""
        _check_choice("value_dtype", self.value_dtype, tuple(VALUE_DTYPES))
        _check_choice("value_bits", self.value_bits, VALUE_BITS)
        _check_choice("rounding", self.rounding, ROUNDINGS)
        if self.rounding == "stochastic" and self.value_bits not in (2, 4, 8):
            raise ValueError(
                f"FlexDeMo: rounding='stochastic' applies to value_bits 2, 4 or 8, not value_bits={self.value_bits}; "
                "set value_bits=2 (or 4, 8), or leave rounding='nearest'."
            )
        _check_bool("pack_indices", self.pack_indices)
        _check_choice("index_coding", self.index_coding, INDEX_CODINGS)

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype values travel in, or None for the parameter's own dtype."""
        return VALUE_DTYPES[self.value_dtype]


@dataclass(kw_only=True)
class ExecutionSettings:
    """Where the step runs: fused kernels, or several replicas simulated in one process."""

    kernels: str = field(
        default="torch",
        metadata={
            "help": "demo: where the step's passes over the momentum run. 'torch' (default): torch operations. "
            "'triton': fused Triton kernels, one program per tile: one folds the gradient into the momentum, picks "
            "the top-k, encodes them for the wire and subtracts what was sent (every update rule and wire format); "
            "a second decodes every replica's coefficients and applies update='sign' (sign=False too) with no dense "
            "update between, or writes the decoded update once for 'orthogonal' and 'adam', whose pass over the "
            "parameters (adam's second moment too) is a third. Same results to float32 rounding. "
            "Needs scheme='demo' without shared_indices, chunk <= 64, 16- or 32-bit parameters, and Triton on a "
            "CUDA GPU (on the CPU only under TRITON_INTERPRET=1, Triton's slow interpreter: for tests)."
        },
    )
    simulate_replicas: int = field(
        default=1,
        metadata={
            "help": "Train R replicas as R nodes would, in one process (bitwise on DeMo's wire): each of R equal "
            "parts of a step's micro-batches is one replica's gradient, folded into that replica's own momentum and "
            "encoded by the "
            "scheme; the payloads meet in a local collective and one update moves the one model. The Trainer "
            "takes gradient_accumulation_steps (a multiple of R) micro-batches per step; plain PyTorch calls "
            "optimizer.next_replica() after each replica's backward. For trying a configuration on one GPU before "
            "renting nodes, and for loss studies. Per-step schemes only (replicas keep one model): "
            "demo, lowrank, random, striding, full; no torchft, one process (no FSDP shards or replicate group)."
        },
    )

    def _check_execution(self) -> None:
        _check_choice("kernels", self.kernels, KERNELS)
        _check_int("simulate_replicas", self.simulate_replicas, low=1)


@dataclass(kw_only=True)
class FaultToleranceSettings:
    """Live fault tolerance on torchft: the quorum, its time limits, and how a slow or lagging node catches up."""

    fault_tolerance: str = field(
        default="off",
        metadata={
            "help": "'torchft': each node is its own job and the replicas meet in a torchft quorum every step, so "
            "a lost node never stops the others (needs TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS)."
        },
    )
    min_replicas: int = field(
        default=1, metadata={"help": "torchft: fewest live nodes a step commits with; fewer and the others wait."}
    )
    ft_timeout: float = field(
        default=30.0,
        metadata={
            "help": "torchft: seconds an exchange or recovery may take before it counts as lost (a commit vote: twice)."
        },
    )
    quorum_timeout: float = field(
        default=120.0,
        metadata={"help": "torchft: seconds to wait for min_replicas live nodes (or the Lighthouse) before stopping."},
    )
    join_quorum: str | None = field(
        default=None,
        metadata={
            "help": "torchft: when a node joins each step's quorum. 'when_ready' (the default): once its payload is "
            "ready, so a late node is left out of the steps it is late for, catches up by replay, and its gradient "
            "joins the next step it is in time for (at most replay_steps old); 'before_forward': every node of the "
            "quorum waits for the slowest one's forward and backward."
        },
    )
    stall_wait: float | None = field(
        default=None,
        metadata={
            "help": "torchft: after a stall of its processes (0.5 s or more in which they did not run: stopped, a "
            "paused VM, a swapping machine), a node asks for its next quorum only once it has run this many seconds "
            "(default 5) without one, so that the others do not wait for it inside a round; it then catches up. With "
            "join_quorum='when_ready', a node the others spent more than 15% of their time waiting for sits out too, "
            "for most of what replay_steps lets it catch up by replay (30 s at most). 0: a node never sits out."
        },
    )
    replay_steps: int | None = field(
        default=None,
        metadata={
            "help": "torchft: each node keeps the last N committed steps' exchanged payloads (default 32), so that a "
            "node that missed up to N commits catches up by replaying them instead of copying the whole state "
            "(0: always copy)."
        },
    )

    def _check_fault_tolerance(self) -> None:
        """``join_quorum``, ``replay_steps`` and ``stall_wait`` given without torchft are refused whatever their value
        (``None`` is "not given"); not given under torchft, they take the settings that keep a slow node from
        slowing the others (:meth:`_resolve_fault_tolerance`)."""
        _check_choice("fault_tolerance", self.fault_tolerance, FAULT_TOLERANCE)
        _check_int("min_replicas", self.min_replicas, low=1)
        _check_float("ft_timeout", self.ft_timeout, low=0.0, low_open=True)
        _check_float("quorum_timeout", self.quorum_timeout, low=0.0, low_open=True)
        if self.join_quorum is not None:
            _check_choice("join_quorum", self.join_quorum, JOIN_QUORUM)
        if self.replay_steps is not None:
            _check_int("replay_steps", self.replay_steps, low=0)
        if self.stall_wait is not None:
            _check_float("stall_wait", self.stall_wait, low=0.0)
        applies_to = {
            "join_quorum": "when a node joins a step's quorum",
            "replay_steps": "a lagging node's catch-up",
            "stall_wait": "when a node that stalled asks for its next quorum",
        }
        for name, what in applies_to.items():
            value = getattr(self, name)
            if value is not None and not self.fault_tolerant:
                shown = f"{value:g}" if isinstance(value, float) else repr(value)
                raise ValueError(
                    f"FlexDeMo: {name}={shown} applies to fault_tolerance='torchft' ({what}), but fault_tolerance "
                    f"is 'off'; drop {name}, or set fault_tolerance=torchft."
                )

    def _resolve_fault_tolerance(self) -> None:
        """Once every given value is checked: the settings not given take their defaults."""
        if self.join_quorum is None:
            self.join_quorum = JOIN_QUORUM_DEFAULT if self.fault_tolerant else "before_forward"
        if self.replay_steps is None:
            self.replay_steps = REPLAY_STEPS_DEFAULT if self.fault_tolerant else 0
        if self.stall_wait is None:
            self.stall_wait = STALL_WAIT_DEFAULT if self.fault_tolerant else 0.0

    @property
    def fault_tolerant(self) -> bool:
        return self.fault_tolerance != "off"


SETTING_GROUPS = (RuleSettings, ReplicationSettings, WireSettings, ExecutionSettings, FaultToleranceSettings)
"""FlexDeMo's settings by concern, in the order the settings page lists them. Each group checks its own fields;
:class:`FlexDeMoConfig`, which has them all, checks how they combine (a group is no config alone: its checks run
when a FlexDeMoConfig is built)."""


@dataclass(kw_only=True)
class FlexDeMoConfig(FaultToleranceSettings, ExecutionSettings, WireSettings, ReplicationSettings, RuleSettings):
    """Hyperparameters of FlexDeMo and its replication schemes: every group of :data:`SETTING_GROUPS`, flat.

    The same names are keyword arguments of :class:`hf_flexdemo.FlexDeMo` and keys of ``optim_args``; each group
    checks its own fields, and this class how they combine (a setting one scheme, rule or wire ignores is refused
    there, naming both).

    Example::

        FlexDeMoConfig(lr=3e-4, topk=32, chunk=64, scheme="demo")
        FlexDeMoConfig.from_optim_args("scheme=diloco,inner_steps=50")
    """

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        self._check_replication()  # first: the other checks ask the scheme's traits
        self._resolve_decay()
        self._apply_wire_preset()
        self._check_wire()
        self._resolve_rules()
        self._check_rule()
        validate_group(
            dataclasses.asdict(self),
            scheme=self.scheme,
            elementwise_update=self.elementwise_update,
            topk_block=self.topk_block,
        )
        self._check_execution()
        self._check_fault_tolerance()
        self._check_what_the_scheme_takes()
        self._check_execution_against_the_rest()
        self._resolve_fault_tolerance()

    def _resolve_decay(self) -> None:
        """``decay`` given to a scheme whose momentum is another setting's is refused; unset, it is DeMo's."""
        if self.decay is not None and self.traits.outer_steps:
            raise ValueError(decay_ignored(self.decay, self.scheme))
        if self.decay is None:
            self.decay = DEFAULT_DECAY

    def _check_what_the_scheme_takes(self) -> None:
        """Settings of the rule, the wire and fault tolerance that the scheme would ignore."""
        if self.replicate_every != 1 and not self.traits.per_step:
            raise ValueError(
                f"FlexDeMo: replicate_every={self.replicate_every} applies to the per-step schemes "
                f"{schemes_where('per_step')}, not to scheme={self.scheme!r}; leave it at 1"
                + (" and set inner_steps instead." if self.traits.outer_steps else ".")
            )
        if self.factor_rank is not None and not self.traits.low_rank:
            raise ValueError(
                f"FlexDeMo: factor_rank={self.factor_rank} applies to scheme='lowrank' (low-rank factors), not "
                f"scheme={self.scheme!r}; drop factor_rank, or write scheme='lowrank'."
            )
        if self.traits.low_rank and self.factor_rank is None:
            self.factor_rank = 1
        if self.value_bits and not (self.traits.top_k or self.traits.low_rank):
            raise ValueError(
                f"FlexDeMo: value_bits={self.value_bits} applies to the top-k schemes {schemes_where('top_k')} and "
                f"to 'lowrank', not "
                f"scheme={self.scheme!r}; leave it at 0 (for fewer bytes there, use value_dtype='bf16'), or for "
                "low-bit outer steps use scheme='sparseloco'."
            )
        if self.value_bits and self.value_dtype != "param":  # after the scheme's own check of value_bits
            raise ValueError(
                f"FlexDeMo: value_dtype={self.value_dtype!r} cannot act with value_bits={self.value_bits}: the values "
                "travel as integer codes with float32 scales, so value_dtype would be ignored. Leave value_dtype at "
                "'param' (drop it), or set value_bits=0 to send values in that dtype."
            )
        if self.pack_indices and not self.traits.top_k:
            raise ValueError(
                f"FlexDeMo: pack_indices=True applies to the top-k schemes {schemes_where('top_k')}, which send "
                f"indices; scheme={self.scheme!r} sends none, so it would be ignored; drop pack_indices."
            )
        if self.scale_topk and not self.traits.top_k:
            raise ValueError(
                f"FlexDeMo: scale_topk=True scales the per-tile top-k of the schemes {schemes_where('top_k')}; "
                f"scheme={self.scheme!r} picks no top-k, so it would be ignored; drop scale_topk."
            )
        if self.topk_block != 1:
            self._check_topk_block()
        if self.overlap and not self.traits.per_step:
            raise ValueError(
                f"FlexDeMo: overlap=True applies to the per-step schemes {schemes_where('per_step')}, not to "
                f"scheme={self.scheme!r}; drop overlap=True."
            )
        if self.shared_indices:
            self._check_shared_indices()
        self._check_index_coding()
        if self.derived_topk is not None:
            self._check_derived_topk()
        if self.replay_steps and not self.traits.replayable:
            raise ValueError(
                f"FlexDeMo: replay_steps={self.replay_steps} cannot apply to scheme={self.scheme!r}: a lagging node "
                "always copies the whole state (DiLoCo's and SparseLoCo's inner steps move each node's parameters by "
                f"its own gradients; one step of full is already a copy). Drop replay_steps (it applies to "
                f"{schemes_where('replayable')})."
            )
        if self.overlap and self.fault_tolerant:
            raise ValueError(
                "FlexDeMo: overlap=True cannot be combined with fault_tolerance='torchft': a step is committed only "
                "once its exchange is known to be complete, which overlap defers to the next step. Drop overlap."
            )

    def _check_execution_against_the_rest(self) -> None:
        if self.kernels != "torch" and "chunk" in WIRE_PRESETS.get(self.wire, {}) and self.chunk > MAX_TILE_SIDE:
            raise ValueError(
                f"FlexDeMo: wire={self.wire!r} tiles by chunk={self.chunk}, but kernels='triton' holds tiles of sides "
                f"up to {MAX_TILE_SIDE}; pick a preset on 64 x 64 tiles (wire='2bit' sends about the same bytes), or "
                "write kernels='torch'."
            )
        if self.kernels != "torch":
            check_kernel_settings(scheme=self.scheme, shared_indices=self.shared_indices, chunk=self.chunk)
        if self.simulate_replicas == 1:
            return
        if not self.traits.per_step:
            raise ValueError(
                f"FlexDeMo: simulate_replicas={self.simulate_replicas} needs replicas that hold one model after every "
                f"step, the per-step schemes {schemes_where('per_step')}; scheme={self.scheme!r} lets each replica's "
                "parameters move on their own. Pick one of those schemes, or leave simulate_replicas at 1 and "
                "launch real nodes."
            )
        if self.fault_tolerant:
            raise ValueError(
                f"FlexDeMo: simulate_replicas={self.simulate_replicas} trains every replica in this one process, so "
                "there is no node to lose; drop fault_tolerance=torchft, or drop simulate_replicas and launch the "
                "nodes."
            )

    def _apply_wire_preset(self) -> None:
        """``wire=NAME`` sets its knobs; one also given with another value than the preset's is refused (a knob at
        its default counts as not given)."""
        if self.wire is None:
            return
        _check_choice("wire", self.wire, tuple(WIRE_PRESETS))
        if not self.traits.dct:
            raise ValueError(
                f"FlexDeMo: wire={self.wire!r} names a format of scheme='demo', not scheme={self.scheme!r}; drop wire, "
                f"or set the scheme's own knobs ({preset_knobs(self.wire)})."
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, value in WIRE_PRESETS[self.wire].items():
            given = getattr(self, key)
            if given != defaults[key] and given != value:
                raise ValueError(
                    f"FlexDeMo: wire={self.wire!r} sets {key}={value}, but {key}={given} is given too; drop {key} to "
                    f"use the preset, or drop wire and set {preset_knobs(self.wire)} yourself."
                )
            setattr(self, key, value)
        area = self.topk_block**2
        if self.topk % area:  # before the general check, which would ask for a topk the preset sets
            fits = [b for b in range(self.topk_block - 1, 0, -1) if self.topk % (b * b) == 0][0]
            raise ValueError(
                f"FlexDeMo: wire={self.wire!r} sends topk={self.topk}, which topk_block={self.topk_block} cannot send "
                f"in whole {self.topk_block} x {self.topk_block} blocks ({self.topk} is no multiple of {area}); write "
                f"topk_block={fits}, or drop wire and set topk to a multiple of {area} with the other knobs yourself."
            )

    def _resolve_rules(self) -> None:
        """``update=None`` becomes the scheme's rule; ``elementwise_update=None`` the default one."""
        unset = self.update is None
        if unset:
            self.update = default_update(self.scheme, self.sign)
        _check_choice("update", self.update, UPDATE_RULES)
        if self.traits.outer_steps and self.update == "sign" and not unset:  # it would train with AdamW inside
            raise ValueError(
                f"FlexDeMo: update='sign' does not apply to scheme={self.scheme!r}: its inner step is AdamW (update "
                "unset) or Muon's on the matrices (update='orthogonal'); drop update, or write update='orthogonal'."
            )
        if self.elementwise_update is None:
            self.elementwise_update = DEFAULT_ELEMENTWISE_UPDATE if self.update == "orthogonal" else "sign"
            return
        _check_choice("elementwise_update", self.elementwise_update, ("sign", "adam"))
        if self.update != "orthogonal":  # it would be ignored
            with_sign = " with sign=False" if not self.sign else ""
            why = f" (the default on scheme={self.scheme!r}{with_sign})" if unset else ""
            fix = "drop elementwise_update, or set update='orthogonal'."
            if default_update(self.scheme, self.sign) != "orthogonal" and not self.traits.outer_steps:
                fix = (
                    "drop elementwise_update (update='orthogonal' applies to 'demo', 'lowrank', 'full', 'none' with "
                    "sign=True)."
                )
            raise ValueError(
                f"FlexDeMo: elementwise_update={self.elementwise_update!r} applies to update='orthogonal' (the rule "
                f"of the tensors it does not orthogonalize), but update is {self.update!r}{why}; {fix}"
            )
        if self.traits.outer_steps and self.elementwise_update != "adam":
            raise ValueError(
                f"FlexDeMo: elementwise_update={self.elementwise_update!r} cannot be the inner step of "
                f"scheme={self.scheme!r}: what it does not orthogonalize takes its inner AdamW; drop "
                "elementwise_update (or write 'adam')."
            )

    def _check_index_coding(self) -> None:
        if self.index_coding == "fixed":
            return
        if not self.traits.top_k or self.shared_indices:
            where = "shared_indices=True (one index set, summed)" if self.shared_indices else f"scheme={self.scheme!r}"
            raise ValueError(
                f"FlexDeMo: index_coding={self.index_coding!r} codes the indices of the top-k schemes "
                f"{schemes_where('top_k')} "
                f"without shared_indices, so with {where} it would be ignored; drop index_coding."
            )
        if not self.pack_indices:
            raise ValueError(
                f"FlexDeMo: index_coding={self.index_coding!r} writes the indices as bit fields, but "
                "pack_indices=False asks for 16-bit ones; set pack_indices=True as well (or pick a wire= preset)."
            )

    def _check_derived_topk(self) -> None:
        if not self.traits.dct or self.shared_indices or self.kernels != "torch":
            where = (
                f"scheme={self.scheme!r}" if not self.traits.dct
                else "shared_indices=True" if self.shared_indices else f"kernels={self.kernels!r}"
            )  # fmt: skip
            raise ValueError(
                f"FlexDeMo: derived_topk={self.derived_topk} applies to scheme='demo' without shared_indices, with "
                f"kernels='torch' (the fused kernels pick DeMo's top-k alone), so with {where} it would be ignored; "
                "drop derived_topk, or use scheme='demo' with kernels='torch'."
            )

    def _check_topk_block(self) -> None:
        block = f"topk_block={self.topk_block}"
        if not self.traits.top_k:
            raise ValueError(
                f"FlexDeMo: {block} picks blocks in the per-tile top-k of the schemes {schemes_where('top_k')}; "
                f"scheme={self.scheme!r} picks no top-k, so it would be ignored; drop topk_block."
            )
        beside = {  # (what is given, what to write instead)
            "shared_indices=True": (self.shared_indices, "drop shared_indices"),
            f"derived_topk={self.derived_topk}": (self.derived_topk is not None, "drop derived_topk"),
            f"kernels={self.kernels!r}": (self.kernels != "torch", "write kernels='torch'"),
        }
        for name, (given, instead) in beside.items():
            if given:
                raise ValueError(
                    f"FlexDeMo: {block} cannot be combined with {name}: blocks are picked by scheme='demo' and "
                    "'sparseloco' from each replica's own top-k, in torch (the fused kernels pick coefficients). "
                    f"Drop topk_block (1: each coefficient on its own), or {instead}."
                )

    def _check_shared_indices(self) -> None:
        if not self.traits.dct:
            raise ValueError(
                f"FlexDeMo: shared_indices=True applies to scheme='demo', not scheme={self.scheme!r}; "
                "leave shared_indices=False."
            )
        # An all-reduce sums what it carries: per-tile codes and packed bits cannot be summed.
        allowed = {"value_bits": (0, "0"), "pack_indices": (False, "False"), "value_dtype": ("param", "'param'")}
        for name, (fine, write) in allowed.items():
            value = getattr(self, name)
            if value != fine and not (name == "value_dtype" and value == "fp32"):
                raise ValueError(
                    f"FlexDeMo: {name}={value!r} cannot be combined with shared_indices=True: the shared index set "
                    "is summed over replicas in an all-reduce, so values and indices travel as float32 numbers "
                    f"(float64 for float64 parameters). Set {name}={write}, or shared_indices=False for DeMo's "
                    "all-gather."
                )

    def acting_settings(self) -> tuple[str, ...]:
        """The names of the settings this configuration reads, in the order a summary lists them.

        A setting the scheme or the update rule ignores is left out (``sign`` next to
        ``update='orthogonal'``, ``topk`` on ``scheme='full'``), so that a line built from these
        says what the run does. ``lr``, ``weight_decay`` and the torchft settings are left to
        the caller.
        """
        traits = self.traits
        if traits.outer_steps:
            tiles = ("topk", "chunk") if traits.top_k else ()
            keys = ["scheme", "inner_steps", *tiles, "outer_lr", "outer_momentum", "betas"]
            keys += ["value_dtype"] if not self.value_bits else []
            keys += ["update"] if self.update == "orthogonal" else []
            keys += ["ns_dtype"] if self.update == "orthogonal" and self.ns_dtype != "auto" else []
            keys += ["ns_steps"] if self.update == "orthogonal" and self.ns_steps is not None else []
        else:
            keys = ["scheme", *(("topk", "chunk") if traits.top_k else ()), "decay", "update"]
            keys += ["sign"] if self.update == "sign" else []  # sign=False: the decoded update as it is
            keys += ["elementwise_update"] if self.update == "orthogonal" else []
            keys += ["ns_dtype"] if self.update == "orthogonal" and self.ns_dtype != "auto" else []
            keys += ["ns_steps"] if self.update == "orthogonal" and self.ns_steps is not None else []
            keys += ["decode"] if traits.dct and not self.shared_indices else []  # shared: a sum
            keys += ["rate"] if traits.subset else []
            keys += ["factor_rank"] if traits.low_rank else []
            keys += ["value_dtype"] if traits.sends and not self.value_bits else []
            keys += ["replicate_every"] if traits.sends else []
        flags = ("scale_topk", "overlap", "value_bits", "pack_indices", "shared_indices")
        keys += [key for key in flags if getattr(self, key)]
        keys += ["topk_block"] if self.topk_block != 1 else []
        keys += ["index_coding"] if self.index_coding != "fixed" else []
        keys += ["derived_topk"] if self.derived_topk is not None else []
        if self.rounding != "nearest":
            keys.append("rounding")
        if self.kernels != "torch":
            keys.append("kernels")
        if self.simulate_replicas != 1:
            keys.append("simulate_replicas")
        return tuple(keys)

    def group_defaults(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in GROUP_KEYS}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_keywords(cls, settings: dict[str, Any]) -> FlexDeMoConfig:
        """``FlexDeMo(params, **settings)``'s settings; a name that is no setting is refused with the closest one."""
        unknown = sorted(set(settings) - set(cls.field_names()))
        if unknown:
            close = difflib.get_close_matches(unknown[0], cls.field_names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"FlexDeMo: {unknown[0]!r} is no setting{hint}. The settings are the fields of FlexDeMoConfig "
                f"(docs/settings.md): {sorted(cls.field_names())}; mesh, replicate_dim and elementwise besides."
            )
        check_knobs_beside_wire(settings, "FlexDeMo")
        return cls(**settings)

    @classmethod
    def from_optim_args(cls, text: str | None, **base: Any) -> FlexDeMoConfig:
        """Parse ``"key=value,key=value"`` (the Trainer's ``optim_args``) on top of ``base``."""
        return cls(**{**base, **parse_optim_args(text)})


OWN_KEYS = tuple(name for name in FlexDeMoConfig.field_names() if name not in SHARED_KEYS)
"""``optim_args`` keys that only FlexDeMo reads: with another ``optim`` they would be ignored."""


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """``"topk=32,sign=false,betas=0.9:0.95"`` -> typed values; unknown keys are an error."""
    values: dict[str, Any] = {}
    if not text:
        return values
    if ";" in text:
        raise ValueError(
            f"FlexDeMo optim_args={text!r}: settings are separated by commas, not semicolons; "
            f"write {text.replace(';', ',')!r}."
        )
    known = {f.name: f for f in dataclasses.fields(FlexDeMoConfig)}
    given: dict[str, str] = {}  # key -> its text as written
    for written in text.split(","):
        if len(written.split()) > 1 and written.count("=") > 1:  # "chunk=64 topk=32": a space for a comma
            raise ValueError(
                f"FlexDeMo optim_args={text!r}: settings are separated by commas; {written.strip()!r} reads as one "
                f"setting. Write {','.join(written.split())!r}."
            )
        item = "".join(written.split())
        if not item:
            continue
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"FlexDeMo optim_args: {item!r} is not of the form key=value.")
        if key not in known:
            raise ValueError(_unknown_key_message(key, raw))
        if key in given:
            raise ValueError(
                f"FlexDeMo optim_args: {key} is given twice ({key}={given[key]} and {key}={raw}); keep the one you "
                "mean."
            )
        given[key] = raw
        values[key] = _parse_value(key, raw, _typed_default(known[key]))
    check_knobs_beside_wire(values, "FlexDeMo optim_args")
    return values


def check_knobs_beside_wire(given: dict[str, Any], where: str) -> None:
    """A knob given beside ``wire`` must be the preset's, even at its default: given, it was meant."""
    wire = given.get("wire")
    preset = WIRE_PRESETS.get(wire, {})
    for key, value in given.items():
        if key in preset and value != preset[key]:
            raise ValueError(
                f"{where}: wire={wire!r} sets {key}={preset[key]}, but {key}={value} is given too; drop {key} to use "
                f"the preset, or drop wire and set {preset_knobs(wire)} yourself."
            )


def _unknown_key_message(key: str, raw: str) -> str:
    """Lists FlexDeMo's own keys only: the shared ones are refused in optim_args (the Trainer has flags)."""
    close = difflib.get_close_matches(key, FlexDeMoConfig.field_names(), n=1)
    hint = f" (did you mean {close[0]!r}? write {close[0]}={raw})" if close else ""
    return (
        f"FlexDeMo optim_args: unknown key {key!r}{hint}. The keys are {sorted(OWN_KEYS)}; lr, weight_decay, betas "
        "and eps come from --learning_rate, --weight_decay, --adam_beta1/2 and --adam_epsilon."
    )


def _typed_default(spec: dataclasses.Field) -> Any:
    """The field's default, or for one that defaults to ``None`` ("not given") a value of its annotated type."""
    if spec.default is not None:
        return spec.default
    annotation = str(spec.type)
    for kind in (bool, int, float):
        if annotation.startswith(f"{kind.__name__} |"):
            return kind()
    return None


def _parse_value(key: str, raw: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if raw.lower() in ("true", "1", "yes"):
                return True
            if raw.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return _parse_float(raw)
        if isinstance(default, tuple):
            return tuple(_parse_float(x) for x in raw.split(":"))
    except ZeroDivisionError:
        raise ValueError(f"FlexDeMo optim_args: {key}={raw!r} divides by zero; write a fraction like 1/128.") from None
    except ValueError:
        kind = "a pair like 0.9:0.999" if isinstance(default, tuple) else type(default).__name__
        raise ValueError(f"FlexDeMo optim_args: {key}={raw!r} is not {kind}.") from None
    return raw


def _parse_float(raw: str) -> float:
    if "/" in raw:  # allow rate=1/128
        num, den = raw.split("/")
        return float(num) / float(den)
    return float(raw)


def default_update(scheme: str, sign: bool = True) -> str:
    """The rule ``update=None`` stands for: ``orthogonal`` where a rule applies, else ``sign``.

    ``random`` and ``striding`` send a scattered subset, which no rule but ``sign`` can take; DiLoCo and
    SparseLoCo move parameters by their own outer step and take AdamW's inner step unless ``update='orthogonal'``
    (``sign`` stands for that AdamW here); ``sign=False`` is a variant of the sign rule (the decoded update as it
    is), so it keeps that rule.
    """
    traits = traits_of(scheme)
    if traits.subset or traits.outer_steps or not sign:
        return "sign"
    return DEFAULT_UPDATE


def decay_ignored(decay: Any, scheme: str, where: str = "") -> str:
    """The refusal of ``decay`` (``where``: in a parameter group) on a scheme that would ignore it."""
    return (
        f"FlexDeMo: decay={decay!r}{where} is the momentum decay of the per-step schemes "
        f"{schemes_where('per_step')}; scheme={scheme!r} would ignore it: its inner step's momentum is betas[0] "
        "(--adam_beta1), and outer_momentum is its outer step's momentum (diloco) or its error feedback's decay "
        "(sparseloco). Drop decay, and set betas or outer_momentum (for the whole optimizer) instead."
    )


def whole_optimizer_setting_in_group(group: dict[str, Any]) -> str | None:
    """The refusal of a setting that holds for the whole optimizer (``outer_momentum``, ``scheme``, ...) given in a
    parameter group, which ``torch.optim`` would keep there unread; None if the group has none. Keys that are no
    setting at all (a group's ``name``, say) stay the user's, as torch allows."""
    given = sorted(set(FlexDeMoConfig.field_names()).difference(GROUP_KEYS).intersection(group))
    if not given:
        return None
    key = given[0]
    what = (
        ", or give the group its own update='adam' or 'sign'"
        if key == "elementwise_update"
        else f"; a group may set {', '.join(GROUP_KEYS)}"
    )
    return (
        f"FlexDeMo: {key}={group[key]!r} in a parameter group; it holds for the whole optimizer and a group's copy "
        f"would be ignored: pass it to FlexDeMo(...) (or optim_args) instead{what}."
    )


def validate_group(group: dict[str, Any], scheme: str, elementwise_update: str = "sign", topk_block: int = 1) -> None:
    """Check the per-group hyperparameters; raises ValueError naming the setting, value and range.

    ``betas`` and ``eps`` belong to the inner AdamW of DiLoCo and SparseLoCo and to ``update='adam'``: others
    do not use them, so the Trainer's ``--adam_beta2 1.0`` (say) is no error there.
    """
    _check_float("lr", group["lr"], low=0.0)
    _check_float("weight_decay", group["weight_decay"], low=0.0)
    _check_float("decay", group["decay"], low=0.0, high=1.0, high_open=True)
    _check_int("chunk", group["chunk"], low=1)
    _check_int("topk", group["topk"], low=1, high=group["chunk"] ** 2, why=" (at most chunk * chunk, a full tile)")
    area = topk_block * topk_block
    if traits_of(scheme).top_k and topk_block > group["chunk"]:
        raise ValueError(
            f"FlexDeMo: topk_block={topk_block} is larger than chunk={group['chunk']}: a block must fit in a tile; "
            f"write topk_block <= {group['chunk']} (one that divides the tiles' sides), or a larger chunk."
        )
    if traits_of(scheme).top_k and group["topk"] % area:
        most = group["chunk"] ** 2 // area * area
        multiple = min(max(area, round(group["topk"] / area) * area), most)
        raise ValueError(
            f"FlexDeMo: topk={group['topk']} with topk_block={topk_block}: topk counts coefficients, sent in whole "
            f"{topk_block} x {topk_block} blocks, so it must be a multiple of {area}; write topk={multiple}, or "
            "topk_block=1."
        )
    _check_bool("sign", group["sign"])
    update = group.get("update", "sign")
    _check_choice("update", update, UPDATE_RULES)
    # Outer-step schemes with update='orthogonal': the groups of embeddings and heads take the inner AdamW.
    elementwise_group = traits_of(scheme).outer_steps and update == elementwise_update == "adam"
    if update != "sign" and not elementwise_group:
        _check_update_rule(update, group["sign"], scheme)
    uses_adam = update == "adam" or (update == "orthogonal" and elementwise_update == "adam")
    if not traits_of(scheme).outer_steps and not uses_adam:
        return
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"FlexDeMo: betas={betas!r} is invalid; betas must be a pair (beta1, beta2).")
    for i, beta in enumerate(betas):
        _check_float(f"betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
    _check_float("eps", group["eps"], low=0.0, low_open=True)


def _check_update_rule(update: str, sign: bool, scheme: str) -> None:
    traits = traits_of(scheme)
    if traits.outer_steps and update != "orthogonal":
        raise ValueError(
            f"FlexDeMo: update={update!r} applies to the per-step schemes {schemes_where('per_step')}, not to "
            f"scheme={scheme!r}, whose inner step is AdamW and whose outer step is its own rule; leave update unset "
            "(inner AdamW), or set update='orthogonal' for Muon's inner step on the matrices."
        )
    if not sign:
        raise ValueError(
            f"FlexDeMo: sign=False applies to update='sign' (it applies the decoded update as it is), not to "
            f"update={update!r}; drop sign=False."
        )
    if traits.subset:
        raise ValueError(
            f"FlexDeMo: update={update!r} needs every entry's update at every replication (orthogonal: whole "
            f"matrices; adam: one bias-corrected second moment), but scheme={scheme!r} sends a scattered subset; use "
            f"scheme='demo' or 'full' with update={update!r}, or update='sign' with {scheme}."
        )


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be one of {allowed}.")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be True or False.")


def _check_int(name: str, value: Any, low: int, high: int | None = None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be an integer.")
    if value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"FlexDeMo: {name}={value} is invalid; {name} must be an integer {allowed}{why}.")


def _check_float(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"FlexDeMo: {name}={value!r} is invalid; {name} must be a number.")
    bad_low = value <= low if low_open else value < low
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        lo = f"{'(' if low_open else '['}{low}"
        hi = f"{high}{')' if high_open else ']'}" if high is not None else "inf)"
        raise ValueError(f"FlexDeMo: {name}={value} is invalid; {name} must be in {lo}, {hi}.")
