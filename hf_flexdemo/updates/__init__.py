"""Update rules: how the decoded, replica-identical update becomes a parameter step.

The replication scheme (:mod:`hf_flexdemo.schemes`) owns the wire: it decides what each
replica sends and decodes what arrives into one update per parameter, the same on every
replica. The rule named by the parameter group's ``update`` turns that update into the step:

- ``orthogonal`` (the default on demo, full and none): ``p -= lr * sqrt(max(rows, cols)) * NS(U)``
  for each 2-D matrix ``U`` (Newton-Schulz orthogonalization, as Muon does), computed by one
  owner process of the node when FSDP2 shards it; other tensors, and the embeddings and heads the Trainer names,
  take the adam rule, as Muon leaves them to AdamW;
- ``adam``: ``p -= lr * g / (sqrt(v_hat) + eps)`` with ``g = u / lr`` and ``v`` a running mean of
  ``g**2`` per entry;
- ``sign``: ``p -= lr * sign(u)`` (DeMo's rule; ``lr * u`` with ``sign=False``).

A rule sees only the decoded update, which is identical on every replica, and computes a
deterministic function of it: replicas stay identical without any inter-node traffic. (DiLoCo and SparseLoCo with
``update='orthogonal'`` also hand the orthogonal rule each replica's own inner update, between outer steps.)
"""

from __future__ import annotations

from ..config import FlexDeMoConfig
from .adam import AdamRule
from .base import Decoded, UpdateRule
from .groups import elementwise_parameters, with_elementwise_groups
from .orthogonal import OrthogonalRule, newton_schulz
from .resume import check_saved_elementwise_rule, check_saved_inner_step, check_saved_rules, check_saved_state_keys
from .sign import SignRule

RULE_CLASSES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in (SignRule, AdamRule, OrthogonalRule)}


def build_rules(config: FlexDeMoConfig) -> dict[str, UpdateRule]:
    """One instance of every rule: each parameter group picks one by name."""
    return {name: cls(config) for name, cls in RULE_CLASSES.items()}


__all__ = [
    "RULE_CLASSES",
    "AdamRule",
    "Decoded",
    "OrthogonalRule",
    "SignRule",
    "UpdateRule",
    "build_rules",
    "check_saved_elementwise_rule",
    "check_saved_inner_step",
    "check_saved_rules",
    "check_saved_state_keys",
    "elementwise_parameters",
    "newton_schulz",
    "with_elementwise_groups",
]
