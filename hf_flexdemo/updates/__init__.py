"""Update rules: how the decoded, replica-identical update becomes a parameter step.

The replication scheme (:mod:`hf_flexdemo.schemes`) owns the wire: it decides what each
replica sends and decodes what arrives into one update per parameter, the same on every
replica. The rule named by the parameter group's ``update`` turns that update into the step:

- ``sign``: ``p -= lr * sign(u)`` (DeMo's rule; ``lr * u`` with ``sign=False``);
- ``adam``: ``p -= lr * u / (sqrt(v) + eps)`` with ``v`` a running mean of ``u**2`` per entry;
- ``orthogonal``: ``p -= lr * sqrt(max(rows, cols)) * NS(U)`` for each 2-D matrix ``U``
  (Newton-Schulz orthogonalization, as Muon does), gathered inside the node when FSDP2
  shards it; other tensors take ``sign``.

A rule sees only the decoded update, which is identical on every replica, and computes a
deterministic function of it: replicas stay identical without any inter-node traffic.
"""

from __future__ import annotations

from ..config import FlexDeMoConfig
from .adaptive import AdaptiveRule
from .base import Decoded, UpdateRule
from .orthogonal import OrthogonalRule, elementwise_parameters, newton_schulz, with_elementwise_groups
from .sign import SignRule

RULE_CLASSES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (SignRule, AdaptiveRule, OrthogonalRule)}


def build_rules(config: FlexDeMoConfig) -> dict[str, UpdateRule]:
    """One instance of every rule: each parameter group picks one by name."""
    return {name: cls(config) for name, cls in RULE_CLASSES.items()}


__all__ = [
    "RULE_CLASSES",
    "AdaptiveRule",
    "Decoded",
    "OrthogonalRule",
    "SignRule",
    "UpdateRule",
    "build_rules",
    "elementwise_parameters",
    "newton_schulz",
    "with_elementwise_groups",
]
