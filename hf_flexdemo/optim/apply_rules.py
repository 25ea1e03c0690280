"""A step's last phase: decoded updates move the parameters through each group's update rule.

Decoded updates are dense, so the rules take them a few buckets at a time, as they are made: the step holds at
most about one bucket's worth beside the state, not the whole model's. The same code applies a step's own exchange
and a step a lagging node replays (:mod:`hf_flexdemo.fault_tolerance`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..buckets import Bucket
from ..schemes import Decoded, ReplicationScheme, StepContext
from ..updates import UpdateRule


def weight_decay(buckets: list[Bucket]) -> None:
    """Weight decay alone, on the buckets' parameters."""
    for bucket in buckets:
        wd = bucket.group["weight_decay"]
        if wd:
            torch._foreach_mul_(bucket.params, 1 - bucket.group["lr"] * wd)


class RuleApplier:
    """Hands decoded updates to the update rules, in batches of at most ``entries()`` whole entries."""

    def __init__(self, scheme: ReplicationScheme, rules: dict[str, UpdateRule], entries: Callable[[], int]):
        self.scheme = scheme
        self.rules = rules
        self.entries = entries
        """Most entries per batch, read at each step (the optimizer's ``bucket_entries``)."""

    def decode_and_apply(self, buckets: list[Bucket], parts: list[Any], ctx: StepContext, *, decay: bool) -> None:
        """Decode each bucket's exchange and move its parameters by its rule (``decay``: with weight decay)."""

        def decoded_updates() -> Iterator[Decoded]:
            for bucket, part in zip(buckets, parts):
                decoded = self.scheme.apply(bucket, part, ctx)
                if decoded is None:
                    if decay:  # nothing to apply: the parameters still decay
                        weight_decay([bucket])
                    continue
                if decay:
                    decoded.decay = 1 - bucket.group["lr"] * bucket.group["weight_decay"]
                yield decoded

        self.apply_in_batches(decoded_updates(), ctx)

    def apply_in_batches(self, decoded: Iterable[Decoded], ctx: StepContext) -> None:
        batch, entries, most = [], 0, self.entries()
        for item in decoded:
            batch.append(item)
            entries += item.bucket.count * item.bucket.full_shape.numel()  # whole shapes: a node's processes agree
            if entries >= most:
                self.apply_rules(batch, ctx)
                batch, entries = [], 0
        self.apply_rules(batch, ctx)

    def apply_rules(self, decoded: list[Decoded], ctx: StepContext) -> None:
        """Each rule takes its buckets together (``orthogonal`` moves a node's shards in two all-to-alls)."""
        by_rule: dict[str, list[Decoded]] = {}
        for item in decoded:
            by_rule.setdefault(item.bucket.group["update"], []).append(item)
        for name, items in by_rule.items():
            self.rules[name].apply(items, ctx)
