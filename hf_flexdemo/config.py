"""FlexDeMo's hyperparameters: one dataclass, one validation, shared by the optimizer and the Trainer.

The same names work as keyword arguments of :class:`hf_flexdemo.FlexDeMo` and as keys of
``TrainingArguments(optim_args="topk=32,chunk=64,scheme=demo")`` (parsed by :mod:`hf_flexdemo.optim_args`).
A setting that only some schemes read defaults to ``None`` ("not given"): given to a scheme that does not read
it, it is refused whatever its value, and it takes its default once every check has passed.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

import torch

from .compression import VALUE_BITS
from .kernels import KERNELS
from .kernels import check_settings as check_kernel_settings
from .optim_args import parse_settings
from .removed import REMOVED_SETTINGS, check_not_removed, removed_message
from .fault_tolerance_settings import (  # noqa: F401  (re-exported)
    FAULT_TOLERANCE,
    JOIN_QUORUM,
    JOIN_QUORUM_DEFAULT,
    REPLAY_STEPS_DEFAULT,
    STALL_WAIT_DEFAULT,
    FaultToleranceSettings,
)
from .group_settings import (
    DEFAULT_DECAY,
    ELEMENTWISE_UPDATE,
    GROUP_KEYS,
    UPDATE_RULES,
    check_bool,
    check_choice,
    check_float,
    check_int,
    decay_ignored,
    default_update,
    validate_group,
)
from .scheme_traits import SCHEME_SETTINGS, SchemeTraits, scheme_names, schemes_reading, schemes_where, traits_of

NS_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "float32": torch.float32}
"""Newton-Schulz's arithmetic (update='orthogonal'); ``auto`` picks one by device
(:func:`hf_flexdemo.updates.orthogonal.newton_schulz_dtype`)."""
NS_DTYPE_CHOICES = ("auto", *NS_DTYPES)

VALUE_DTYPES: dict[str, torch.dtype | None] = {
    "param": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
INDEX_CODINGS = ("fixed", "elias_fano")


def _packed(topk: int, value_bits: int) -> dict[str, Any]:
    """A preset's knobs: the indices in Elias-Fano code, which sends the same indices in fewer bits."""
    return {"topk": topk, "value_bits": value_bits, "pack_indices": True, "index_coding": "elias_fano"}


WIRE_PRESETS: dict[str, dict[str, Any]] = {
    "top128_4bit": _packed(128, 4),
    "top96_2bit": _packed(96, 2),
    "top64_1bit": _packed(64, 1),
    "2bit": _packed(32, 2),
    "top4_1bit": {"topk": 4, "value_bits": 1, "pack_indices": True, "index_coding": "fixed"},  # no gain at 4
}
"""``wire=NAME``: the presets, the frontier of bytes against a whole run's loss, from the default to the most
compressed. Their bytes, links and loss: README.md, "Choosing a wire"."""
DEMO_WIRE = {"topk": 32, "value_bits": 0, "pack_indices": False, "index_coding": "fixed"}
"""DeMo's own wire (fp32 values, 16-bit indices): the default before the long runs, which it lost (more bytes than
the default for a loss above AdamW-HSDP's). ``wire=demo`` names it, so that those runs resume with it."""
NAMED_WIRES: dict[str, dict[str, Any]] = {"demo": DEMO_WIRE, **WIRE_PRESETS}
"""Every name ``wire=`` takes."""
WIRE_KNOBS = "topk, value_bits, pack_indices and index_coding"
"""What every named wire sets."""
DEFAULT_WIRE = "top128_4bit"
"""The wire of scheme='demo' when neither ``wire`` nor any of its knobs is given: the long runs' winner
(BENCHMARKS.md, "Which wire is the default, over a whole run?"). Before it, the default was ``demo``."""
OLD_DEFAULT_WIRE = "demo"
"""What a run that named no wire trained with before :data:`DEFAULT_WIRE`: its checkpoints resume with it."""
WIRE_CHOICES = ("topk", "chunk", "value_bits", "pack_indices", "index_coding", "value_dtype")
"""Settings that say how values travel: any one given, the wire is as given and :data:`DEFAULT_WIRE` does not apply
(``value_dtype``: values sent as numbers, which the default wire's codes are not; ``chunk``: the default's 128
coefficients are measured on 64 x 64 tiles, and a tile of 8 x 8 holds only 64)."""
KNOBS_NOT_GIVEN = {"value_bits": 0, "pack_indices": False, "index_coding": "fixed"}
"""What the knobs (``topk`` aside: :data:`NOT_GIVEN_DEFAULTS`) take where some are given and no preset applies."""


def preset_knobs(name: str) -> str:
    """``"topk, value_bits, pack_indices and index_coding"``: the settings ``wire=name`` sets, for a message."""
    keys = list(NAMED_WIRES[name])
    return f"{', '.join(keys[:-1])} and {keys[-1]}"


ROUNDINGS = ("nearest", "stochastic")


SHARED_KEYS = ("lr", "weight_decay", "betas", "eps")
"""Hyperparameters other optimizers take as well (from ``TrainingArguments``)."""

NOT_GIVEN_DEFAULTS: dict[str, Any] = {
    "topk": 32,
    "chunk": 64,
    "rate": 1 / 128,
    "seed": 0,
    "inner_steps": 100,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "value_dtype": "param",
}
"""What the settings only some schemes read (:data:`SCHEME_SETTINGS`) take when they are not given."""
assert set(NOT_GIVEN_DEFAULTS) == set(SCHEME_SETTINGS)


@dataclass(kw_only=True)
class RuleSettings:
    """The step: the momentum, and how the decoded update becomes a parameter step."""

    lr: float = field(default=1e-3, metadata={"help": "Step size (update='sign': each entry moves by lr)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay: p *= 1 - lr * wd."})
    decay: float | None = field(
        default=None,
        metadata={
            "help": f"Momentum decay beta of the per-step schemes: m = beta * m + lr * grad. Unset: {DEFAULT_DECAY}. "
            "diloco and sparseloco refuse it (their momenta are betas[0] and outer_momentum)."
        },
    )
    sign: bool | None = field(
        default=None,
        metadata={"help": "update='sign': apply the sign of the decoded update (unset: True); False applies it as is."},
    )
    update: str | None = field(
        default=None,
        metadata={
            "help": "How the decoded update becomes a step: 'orthogonal' (Newton-Schulz per 2-D matrix, as Muon; "
            "the rest takes 'adam'), 'adam' or 'sign' (DeMo's). Unset: 'orthogonal' on demo, full and none, 'sign' "
            "on random and striding; diloco, sparseloco: inner AdamW."
        },
    )
    ns_dtype: str = field(
        default="auto",
        metadata={
            "help": "update='orthogonal': dtype of the Newton-Schulz iteration. 'auto': bf16 where every replica's "
            "device multiplies bf16 fast (CUDA 8.0+, a CPU with AVX-512 BF16 or AMX), float32 elsewhere; or "
            "'bf16', 'float32'."
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
        """Once ``update`` is resolved (:meth:`FlexDeMoConfig._resolve_rules`): Newton-Schulz's dtype needs its
        rule."""
        check_choice("ns_dtype", self.ns_dtype, NS_DTYPE_CHOICES)
        if self.ns_dtype != "auto" and self.update != "orthogonal":  # it would be ignored
            raise ValueError(
                f"FlexDeMo: ns_dtype={self.ns_dtype!r} applies to update='orthogonal' (its Newton-Schulz iteration), "
                f"but update is {self.update!r}; drop ns_dtype, or set update='orthogonal'."
            )

    @property
    def elementwise_update(self) -> str:
        """The rule of what update='orthogonal' does not orthogonalize: :data:`ELEMENTWISE_UPDATE` (under the other
        rules, which treat every tensor alike, 'sign', unread)."""
        return ELEMENTWISE_UPDATE if self.update == "orthogonal" else "sign"


@dataclass(kw_only=True)
class ReplicationSettings:
    """The exchange: which scheme, what it sends of the momentum, and when."""

    scheme: str = field(
        default="demo",
        metadata={
            "help": "Replication scheme: 'demo' (the default), 'random', 'striding', 'diloco', 'sparseloco', 'full' "
            "or 'none'."
        },
    )
    topk: int | None = field(
        default=None,
        metadata={
            "help": "demo, sparseloco: coefficients (entries) sent per tile. Unset: 128 (the default wire), else 32."
        },
    )
    chunk: int | None = field(
        default=None, metadata={"help": "demo, sparseloco: largest tile side of the chunked DCT. Unset: 64."}
    )
    scale_topk: bool = field(
        default=False,
        metadata={
            "help": "demo, sparseloco: a tile smaller than chunk x chunk keeps topk x its area / chunk**2 coefficients "
            "(at least 1) instead of topk, so the bytes follow the parameter count whatever the model's sides."
        },
    )
    replicate_every: int = field(
        default=1, metadata={"help": "Per-step schemes: replicate every N optimizer steps, accumulate in between."}
    )
    rate: float | None = field(
        default=None,
        metadata={"help": "random, striding: fraction of momentum entries sent per replication. Unset: 1/128."},
    )
    seed: int | None = field(
        default=None,
        metadata={
            "help": "random: seed every replica shares to pick the same entries; rounding='stochastic': of its draws. "
            "Unset: 0."
        },
    )
    inner_steps: int | None = field(
        default=None, metadata={"help": "diloco, sparseloco: H, the local steps between outer steps. Unset: 100."}
    )
    outer_lr: float | None = field(
        default=None,
        metadata={"help": "diloco: lr of the outer Nesterov SGD; sparseloco: of the outer step. Unset: 0.7."},
    )
    outer_momentum: float | None = field(
        default=None,
        metadata={
            "help": "diloco: momentum of the outer Nesterov SGD; sparseloco: decay of the error feedback. Unset: 0.9."
        },
    )
    overlap: bool = field(
        default=False,
        metadata={"help": "Per-step schemes: apply each step's exchange one step late, hiding it behind compute."},
    )

    def _check_replication(self) -> None:
        """The values given; a setting still ``None`` was not given (:data:`SCHEME_SETTINGS`)."""
        check_choice("scheme", self.scheme, scheme_names())
        check_int("replicate_every", self.replicate_every, low=1)
        for name in ("overlap", "scale_topk"):
            check_bool(name, getattr(self, name))
        if self.rate is not None:
            check_float("rate", self.rate, low=0.0, high=1.0, low_open=True)
        if self.seed is not None:
            check_int("seed", self.seed, low=0)
        if self.inner_steps is not None:
            check_int("inner_steps", self.inner_steps, low=1)
        if self.outer_lr is not None:
            check_float("outer_lr", self.outer_lr, low=0.0)
        if self.outer_momentum is not None:
            check_float("outer_momentum", self.outer_momentum, low=0.0, high=1.0, high_open=True)

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
            "help": f"demo: a measured wire format by name, one of {list(NAMED_WIRES)}; it sets {WIRE_KNOBS} (a knob "
            f"also given must agree). Unset: {DEFAULT_WIRE!r} on scheme='demo' where no knob, chunk or value_dtype "
            "is given."
        },
    )
    value_dtype: str | None = field(
        default=None,
        metadata={
            "help": "Every scheme but none, with value_bits=0: dtype of values on the wire, 'param' (the parameter's, "
            "the default), 'bf16', 'fp16' or 'fp32'."
        },
    )
    value_bits: int | None = field(
        default=None,
        metadata={
            "help": "demo, sparseloco: 0 sends values in value_dtype; 1 their signs and each tile's mean magnitude; "
            "2, 4 or 8 an integer code per value and one float32 scale per tile. The rounding error stays in the "
            "momentum. Unset: the default wire's, else 0."
        },
    )
    rounding: str = field(
        default="nearest",
        metadata={"help": "value_bits 2, 4, 8: 'nearest' or 'stochastic' (unbiased) rounding."},
    )
    pack_indices: bool | None = field(
        default=None,
        metadata={
            "help": "demo, sparseloco: send each index in the bits a tile position needs (12 for 64x64), not 16. "
            "Unset: the default wire's, else False."
        },
    )
    index_coding: str | None = field(
        default=None,
        metadata={
            "help": "demo, sparseloco, with pack_indices=True: 'fixed' gives every index the same bits; "
            "'elias_fano' codes each tile's ascending indices in at most 2 + log2(tile / topk) bits each. Unset: "
            "the default wire's, else 'fixed'."
        },
    )

    def _check_wire(self) -> None:
        """Once a ``wire`` preset has set its knobs (:meth:`FlexDeMoConfig._apply_wire_preset`)."""
        if self.value_dtype is not None:
            check_choice("value_dtype", self.value_dtype, tuple(VALUE_DTYPES))
        check_choice("value_bits", self.value_bits, VALUE_BITS)
        check_choice("rounding", self.rounding, ROUNDINGS)
        if self.rounding == "stochastic" and self.value_bits not in (2, 4, 8):
            raise ValueError(
                f"FlexDeMo: rounding='stochastic' applies to value_bits 2, 4 or 8, not value_bits={self.value_bits}; "
                "set value_bits=2 (or 4, 8), or leave rounding='nearest'."
            )
        check_bool("pack_indices", self.pack_indices)
        check_choice("index_coding", self.index_coding, INDEX_CODINGS)

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype values travel in, or None for the parameter's own dtype."""
        return VALUE_DTYPES[self.value_dtype or "param"]


@dataclass(kw_only=True)
class ExecutionSettings:
    """Where the step runs: fused kernels, or several replicas simulated in one process."""

    kernels: str = field(
        default="torch",
        metadata={
            "help": "demo: 'torch' (default) runs the step as torch operations; 'triton' as fused Triton kernels, "
            "the same results to float32 rounding. Needs chunk <= 64, 16- or 32-bit parameters "
            "and a CUDA GPU."
        },
    )
    simulate_replicas: int = field(
        default=1,
        metadata={
            "help": "Train R replicas as R nodes would, in one process (bitwise on DeMo's wire): each takes 1/R of a "
            "step's micro-batches. Per-step schemes; no torchft; one process (no FSDP shards or replicate group)."
        },
    )

    def _check_execution(self) -> None:
        check_choice("kernels", self.kernels, KERNELS)
        check_int("simulate_replicas", self.simulate_replicas, low=1)


SETTING_GROUPS = (RuleSettings, ReplicationSettings, WireSettings, ExecutionSettings, FaultToleranceSettings)
"""FlexDeMo's settings by concern. Each group checks its own fields; :class:`FlexDeMoConfig`, which has them all,
checks how they combine (a group is no config alone: its checks run when a FlexDeMoConfig is built)."""

COMMON_SETTINGS = (
    "wire",
    "scheme",
    "topk",
    "chunk",
    "update",
    "value_bits",
    "value_dtype",
    "inner_steps",
    "simulate_replicas",
    "fault_tolerance",
)
"""The settings most users touch, in the order the settings page lists them first."""
ADVANCED_WIRE_SETTINGS = ("pack_indices", "index_coding", "scale_topk")
"""The wire's own knobs, which the ``wire`` presets set: the settings page lists them apart."""


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
        check_not_removed({"scheme": self.scheme, "wire": self.wire})
        self._check_replication()  # first: the other checks ask the scheme's traits
        self._check_what_the_scheme_reads()
        self._resolve_decay()
        self._apply_wire_preset()
        self._check_value_bits()
        self._resolve_not_given()
        self._check_wire()
        self._resolve_rules()
        self._check_rule()
        validate_group(dataclasses.asdict(self), scheme=self.scheme, elementwise_update=self.elementwise_update)
        self._check_execution()
        self._check_fault_tolerance()
        self._check_what_the_scheme_takes()
        self._check_execution_against_the_rest()
        self._resolve_fault_tolerance()

    def _check_what_the_scheme_reads(self) -> None:
        """A setting of :data:`SCHEME_SETTINGS` given to a scheme whose traits do not read it is refused, whatever
        its value (``seed`` is also read by stochastic rounding)."""
        for name in SCHEME_SETTINGS:
            value = getattr(self, name)
            if value is None or name in self.traits.reads or (name == "seed" and self.rounding == "stochastic"):
                continue
            readers = schemes_reading(name)
            what = {
                "topk": "the per-tile top-k",
                "chunk": "the tiles' side",
                "inner_steps": "the local steps between outer steps",
                "outer_lr": "the outer step's lr",
                "outer_momentum": "the outer step's momentum",
                "rate": "the share of entries sent",
                "seed": "the entries' draws; rounding='stochastic' reads it too",
                "value_dtype": "the dtype of the values sent",
            }[name]
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            names = ("the scheme " if len(readers) == 1 else "the schemes ") + ", ".join(map(repr, readers))
            raise ValueError(
                f"FlexDeMo: {name}={shown} applies to {names} ({what}), not scheme={self.scheme!r}; drop "
                f"{name}, or write scheme={readers[0]}."
            )

    def _resolve_not_given(self) -> None:
        """Once the given ones are checked: the settings not given take their defaults."""
        for name, default in NOT_GIVEN_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)

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
        if self.overlap and not self.traits.per_step:
            raise ValueError(
                f"FlexDeMo: overlap=True applies to the per-step schemes {schemes_where('per_step')}, not to "
                f"scheme={self.scheme!r}; drop overlap=True."
            )
        self._check_index_coding()
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
        if self.kernels != "torch":
            check_kernel_settings(scheme=self.scheme, chunk=self.chunk)
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

    def _check_value_bits(self) -> None:
        """Once a preset has set ``value_bits``, before ``value_dtype`` takes its default."""
        if self.value_bits and not self.traits.top_k:
            raise ValueError(
                f"FlexDeMo: value_bits={self.value_bits} applies to the top-k schemes {schemes_where('top_k')}, not "
                f"scheme={self.scheme!r}; leave it at 0 (for fewer bytes there, use value_dtype='bf16'), or for "
                "low-bit outer steps use scheme='sparseloco'."
            )
        if self.value_bits and self.value_dtype is not None:  # after the scheme's own check of value_bits
            raise ValueError(
                f"FlexDeMo: value_dtype={self.value_dtype!r} cannot act with value_bits={self.value_bits}: the values "
                "travel as integer codes with float32 scales, so value_dtype would be ignored. Drop value_dtype, or "
                "set value_bits=0 to send values in that dtype."
            )

    def _apply_wire_preset(self) -> None:
        """``wire=NAME`` sets its knobs; one also given with another value than the preset's is refused. With no
        ``wire`` and no knob given, scheme='demo' takes :data:`DEFAULT_WIRE`; knobs still unset take
        :data:`KNOBS_NOT_GIVEN`."""
        knobs_given = any(getattr(self, key) is not None for key in WIRE_CHOICES)
        if self.wire is None and self.traits.dct and not knobs_given:
            self.wire = DEFAULT_WIRE
        if self.wire is not None:
            self._set_preset_knobs()
        for key, value in KNOBS_NOT_GIVEN.items():
            if getattr(self, key) is None:
                setattr(self, key, value)

    def _set_preset_knobs(self) -> None:
        check_choice("wire", self.wire, tuple(NAMED_WIRES))
        if not self.traits.dct:
            raise ValueError(
                f"FlexDeMo: wire={self.wire!r} names a format of scheme='demo', not scheme={self.scheme!r}; drop wire, "
                f"or set the scheme's own knobs ({preset_knobs(self.wire)})."
            )
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, value in NAMED_WIRES[self.wire].items():
            given = getattr(self, key)
            if given != defaults[key] and given != value:
                raise ValueError(
                    f"FlexDeMo: wire={self.wire!r} sets {key}={value}, but {key}={given} is given too; drop {key} to "
                    f"use the preset, or drop wire and set {preset_knobs(self.wire)} yourself."
                )
            setattr(self, key, value)

    def _resolve_rules(self) -> None:
        """``update=None`` becomes the scheme's rule; ``sign`` given beside a rule that does not read it is refused,
        and unset it is True."""
        unset = self.update is None
        if unset:
            self.update = default_update(self.scheme, self.sign is not False)
        check_choice("update", self.update, UPDATE_RULES)
        if self.traits.outer_steps and self.update == "sign" and not unset:  # it would train with AdamW inside
            raise ValueError(
                f"FlexDeMo: update='sign' does not apply to scheme={self.scheme!r}: its inner step is AdamW (update "
                "unset) or Muon's on the matrices (update='orthogonal'); drop update, or write update='orthogonal'."
            )
        if self.sign is not None:
            check_bool("sign", self.sign)
            if self.update != "sign" or self.traits.outer_steps:
                rule = "its inner AdamW" if self.traits.outer_steps and unset else f"update={self.update!r}"
                why = f" (the default on scheme={self.scheme!r})" if unset else ""
                raise ValueError(
                    f"FlexDeMo: sign={self.sign} applies to update='sign' on the per-step schemes, but this run "
                    f"takes {rule}{why}; drop sign"
                    + (", or write update=sign." if not self.traits.outer_steps else ".")
                )
        else:
            self.sign = True

    def _check_index_coding(self) -> None:
        if self.index_coding == "fixed":
            return
        if not self.traits.top_k:
            raise ValueError(
                f"FlexDeMo: index_coding={self.index_coding!r} codes the indices of the top-k schemes "
                f"{schemes_where('top_k')}, so with scheme={self.scheme!r} it would be ignored; drop index_coding."
            )
        if not self.pack_indices:
            raise ValueError(
                f"FlexDeMo: index_coding={self.index_coding!r} writes the indices as bit fields, but "
                "pack_indices=False asks for 16-bit ones; set pack_indices=True as well (or pick a wire= preset)."
            )

    def acting_settings(self) -> tuple[str, ...]:
        """The names of the settings this configuration reads, in the order a summary lists them.

        A setting the scheme or the update rule ignores is left out (``sign`` next to
        ``update='orthogonal'``, ``topk`` on ``scheme='full'``), so that a line built from these
        says what the run does. ``lr``, ``weight_decay`` and the torchft settings are left to
        the caller.
        """
        traits = self.traits
        orthogonal = self.update == "orthogonal"
        if traits.outer_steps:
            tiles = ("topk", "chunk") if traits.top_k else ()
            keys = ["scheme", "inner_steps", *tiles, "outer_lr", "outer_momentum", "betas"]
            keys += ["value_dtype"] if not self.value_bits else []
            keys += ["update"] if orthogonal else []
        else:
            keys = ["scheme", *(("topk", "chunk") if traits.top_k else ()), "decay", "update"]
            keys += ["sign"] if self.update == "sign" else []  # sign=False: the decoded update as it is
            keys += ["rate"] if traits.subset else []
            keys += ["value_dtype"] if traits.sends and not self.value_bits else []
            keys += ["replicate_every"] if traits.sends else []
        keys += ["ns_dtype"] if orthogonal and self.ns_dtype != "auto" else []
        flags = ("scale_topk", "overlap", "value_bits", "pack_indices")
        keys += [key for key in flags if getattr(self, key)]
        keys += ["index_coding"] if self.index_coding != "fixed" else []
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
        check_not_removed(settings)
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


def whole_optimizer_setting_in_group(group: dict[str, Any]) -> str | None:
    """The refusal of a setting that holds for the whole optimizer (``outer_momentum``, ``scheme``, ...) given in a
    parameter group, which ``torch.optim`` would keep there unread; None if the group has none. Keys that are no
    setting at all (a group's ``name``, say) stay the user's, as torch allows."""
    removed = sorted(set(REMOVED_SETTINGS).intersection(group))
    if removed:
        return removed_message(removed[0], where="FlexDeMo: a parameter group's")
    given = sorted(set(FlexDeMoConfig.field_names()).difference(GROUP_KEYS).intersection(group))
    if not given:
        return None
    key = given[0]
    what = f"; a group may set {', '.join(GROUP_KEYS)}"
    return (
        f"FlexDeMo: {key}={group[key]!r} in a parameter group; it holds for the whole optimizer and a group's copy "
        f"would be ignored: pass it to FlexDeMo(...) (or optim_args) instead{what}."
    )


OWN_KEYS = tuple(name for name in FlexDeMoConfig.field_names() if name not in SHARED_KEYS)
"""``optim_args`` keys that only FlexDeMo reads: with another ``optim`` they would be ignored."""


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """``"topk=32,sign=false,betas=0.9:0.95"`` -> typed values (:mod:`hf_flexdemo.optim_args`); unknown keys, removed
    ones and knobs that disagree with ``wire`` are an error."""
    values = parse_settings(text, {f.name: f for f in dataclasses.fields(FlexDeMoConfig)}, OWN_KEYS)
    check_knobs_beside_wire(values, "FlexDeMo optim_args")
    return values


def check_knobs_beside_wire(given: dict[str, Any], where: str) -> None:
    """A knob given beside ``wire`` must be the preset's, even at its default: given, it was meant."""
    wire = given.get("wire")
    preset = NAMED_WIRES.get(wire, {})
    for key, value in given.items():
        if key in preset and value != preset[key]:
            raise ValueError(
                f"{where}: wire={wire!r} sets {key}={preset[key]}, but {key}={value} is given too; drop {key} to use "
                f"the preset, or drop wire and set {preset_knobs(wire)} yourself."
            )
