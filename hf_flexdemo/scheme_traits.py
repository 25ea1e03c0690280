"""What each replication scheme supports: declared once, on its class, and looked up here by the scheme's name.

A scheme class (:mod:`hf_flexdemo.schemes`) that has a ``name`` registers its :class:`SchemeTraits` when it is
defined. The settings (:mod:`hf_flexdemo.config`), the kernels and the fault-tolerant rounds ask here which schemes
a setting applies to, so that a new scheme is one class in one file. This module imports nothing of the package:
the schemes import the settings, and the settings read the traits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SchemeTraits:
    """What one scheme does, as the settings that apply to it depend on."""

    per_step: bool = False
    """Every step folds the gradient into a momentum, and replication steps move every replica by one decoded update:
    ``replicate_every``, ``overlap`` and ``simulate_replicas`` apply."""
    replayable: bool = False
    """Parameters move by the exchanged update alone, from a compressed payload: a lagging torchft node replays
    missed steps for less than a copy of the state (``full`` sends every entry: one step is already a copy)."""
    outer_steps: bool = False
    """Local inner steps and an outer step every ``inner_steps`` (DiLoCo's kind): the inner step is AdamW's
    (``betas`` and ``eps``), or with ``update='orthogonal'`` the orthogonal rule's on the replica's own momentum; the
    other update rules, whose step is the per-step schemes', do not apply."""
    top_k: bool = False
    """Sends each tile's top-k entries: ``topk``, ``chunk``, ``value_bits``, ``pack_indices``, ``index_coding``."""
    dct: bool = False
    """DeMo's top-k of the momentum's DCT: ``wire`` presets."""
    subset: bool = False
    """Sends a scattered subset of the momentum's entries (``rate``): only the sign rule takes it."""
    seeded: bool = False
    """Draws the entries it sends from a generator every replica seeds alike with ``seed``."""
    fused_kernels: bool = False
    """``kernels='triton'`` fuses its passes."""
    payload_first: bool = False
    """Its payload depends on this replica's state alone (no quorum's step or rank): under torchft a node that joins
    when ready encodes it before asking for the quorum."""
    sends: bool = True
    """Anything crosses nodes (``none`` sends nothing): ``value_dtype`` and ``replicate_every`` apply."""

    @property
    def reads(self) -> frozenset[str]:
        """The settings of :data:`SCHEME_SETTINGS` this scheme reads, from the traits above: any other one given is
        refused (:mod:`hf_flexdemo.config`)."""
        reads = {"topk", "chunk"} if self.top_k else set()
        reads |= {"inner_steps", "outer_lr", "outer_momentum"} if self.outer_steps else set()
        reads |= {"rate"} if self.subset else set()
        reads |= {"seed"} if self.seeded else set()
        reads |= {"value_dtype"} if self.sends else set()
        return frozenset(reads)


SCHEME_SETTINGS = ("topk", "chunk", "inner_steps", "outer_lr", "outer_momentum", "rate", "seed", "value_dtype")
"""Settings only some schemes read (:attr:`SchemeTraits.reads`): given to another, they are refused whatever their
value (unset, they are ``None`` until the config resolves them)."""


_REGISTERED: dict[str, type] = {}
"""Scheme name -> its class (a ``ReplicationScheme`` with a ``traits`` attribute)."""


def register(scheme_class: type) -> None:
    """Called by each named scheme class as it is defined (``ReplicationScheme.__init_subclass__``)."""
    name = scheme_class.name
    if _REGISTERED.get(name, scheme_class) is not scheme_class:
        raise RuntimeError(f"FlexDeMo: {scheme_class.__name__} and {_REGISTERED[name].__name__} both call themselves "
                           f"scheme {name!r}")  # fmt: skip
    _REGISTERED[name] = scheme_class


def scheme_class(scheme: str) -> type:
    """The class of scheme ``scheme`` (one of :func:`scheme_names`)."""
    scheme_names()
    return _REGISTERED[scheme]


def scheme_names() -> tuple[str, ...]:
    """Every scheme, in the order the classes were defined."""
    if not _REGISTERED:
        raise RuntimeError("FlexDeMo: no replication scheme is defined yet; import hf_flexdemo first")
    return tuple(_REGISTERED)


def traits_of(scheme: str) -> SchemeTraits:
    return scheme_class(scheme).traits


def schemes_reading(setting: str) -> tuple[str, ...]:
    """The schemes whose traits read ``setting`` (one of :data:`SCHEME_SETTINGS`)."""
    assert setting in SCHEME_SETTINGS, setting
    return tuple(name for name in scheme_names() if setting in traits_of(name).reads)


def schemes_where(trait: str) -> tuple[str, ...]:
    """The schemes that have ``trait`` (a :class:`SchemeTraits` field), for messages that name them."""
    assert trait in {f.name for f in fields(SchemeTraits)}, trait
    return tuple(name for name in scheme_names() if getattr(traits_of(name), trait))
