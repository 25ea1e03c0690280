"""Record every collective that crosses nodes, by wrapping torch.distributed's functions.

A test-side stand-in for a network tap: each call is recorded with the global ranks of its
group, so calls whose group spans more than one (simulated) node are the inter-node
traffic. Bytes are what the collective's usual algorithm sends per process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

WRAPPED = tuple(
    name
    for name in (
        "all_gather_single",
        "all_gather_into_tensor",
        "all_reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_to_all_single",
    )
    if hasattr(dist, name)
)
GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single")
"""Collectives whose input is split among the group (an all-to-all's even split is counted)."""


@dataclass
class CommSpy:
    processes_per_node: int
    calls: list[dict] = field(default_factory=list)
    _depth: int = 0  # a wrapped function that calls another wrapped one is recorded once

    def node_of(self, rank: int) -> int:
        return rank // self.processes_per_node

    def _record(self, name: str, tensor: torch.Tensor, group) -> None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        nodes = {self.node_of(r) for r in ranks}
        size = len(ranks)
        payload = tensor.numel() * tensor.element_size()
        if name == "all_reduce":
            sent = round(2 * (size - 1) * payload / size)
        elif name in GATHERS:
            sent = (size - 1) * payload
        elif name in SCATTERS:
            sent = round((size - 1) * payload / size)
        else:  # broadcast: bounded by what the source sends
            sent = payload
        self.calls.append(
            {"op": name, "ranks": ranks, "inter_node": len(nodes) > 1, "bytes": sent, "dtype": str(tensor.dtype)}
        )

    def inter_node(self) -> list[dict]:
        return [c for c in self.calls if c["inter_node"]]

    def intra_node(self, op: str) -> list[dict]:
        return [c for c in self.calls if not c["inter_node"] and c["op"] == op]

    def inter_node_bytes(self, ops: tuple[str, ...] | None = None) -> int:
        return sum(c["bytes"] for c in self.inter_node() if ops is None or c["op"] in ops)

    def clear(self) -> None:
        self.calls.clear()

    @contextlib.contextmanager
    def watching(self):
        originals = {name: getattr(dist, name) for name in WRAPPED}

        def wrap(name, fn):
            def spy(*args, **kwargs):
                group = kwargs.get("group")
                if name in (*GATHERS[:2], *SCATTERS):
                    tensor = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
                elif name == "all_gather":
                    tensor = args[1] if len(args) > 1 else kwargs["tensor"]
                else:
                    tensor = args[0] if args else kwargs["tensor"]
                if name == "broadcast" and group is None and len(args) > 2:
                    group = args[2]
                if self._depth == 0:
                    self._record(name, tensor, group)
                self._depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self._depth -= 1

            return spy

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
