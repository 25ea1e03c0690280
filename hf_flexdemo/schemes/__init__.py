"""Replication schemes of the DeToNATION framework, chosen by name."""

from __future__ import annotations

from ..config import FlexDeMoConfig
from ..scheme_traits import scheme_class, scheme_names
from .base import Collective, Decoded, ParamSlot, ReplicationScheme, StepContext
from .demo import DeMoScheme, check_saved_tiles
from .dense import FullScheme, NoneScheme
from .diloco import DiLoCoScheme
from .sparseloco import SparseLoCoScheme
from .subset import RandomScheme, StridingScheme

SCHEME_CLASSES: dict[str, type[ReplicationScheme]] = {name: scheme_class(name) for name in scheme_names()}
"""Every scheme by name: the classes above registered themselves (:mod:`hf_flexdemo.scheme_traits`)."""


def build_scheme(config: FlexDeMoConfig) -> ReplicationScheme:
    return scheme_class(config.scheme)(config)


__all__ = [
    "SCHEME_CLASSES",
    "Collective",
    "DeMoScheme",
    "Decoded",
    "DiLoCoScheme",
    "FullScheme",
    "NoneScheme",
    "ParamSlot",
    "RandomScheme",
    "ReplicationScheme",
    "SparseLoCoScheme",
    "StepContext",
    "StridingScheme",
    "build_scheme",
    "check_saved_tiles",
]
