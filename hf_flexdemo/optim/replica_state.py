"""What replicas must share, for fault tolerance: a healing node's copy, a step's undo, the layout check.

Under torchft (:mod:`hf_flexdemo.fault_tolerance`) a node that is behind copies a live peer's
parameters and shared state; a step that a node does not commit is undone from a copy taken
before its exchange; and a node that joins is compared with the others on its settings and
shapes before it exchanges anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..buckets import Bucket
from ..dtensor_utils import local_tensor
from ..state_store import StateView
from ..topology import ReplicaTopology


class ReplicaState:
    """FlexDeMo's healing and undo (a mixin: it reads the optimizer's scheme, rules, state and groups)."""

    def _ordered_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def replica_state(self) -> dict[str, Any]:
        """Copies of what must be equal on every replica: parameters, step counts, the scheme's shared state,
        and the groups' hyperparameters (the lr a scheduler has set)."""
        keep = ("step", *self.scheme.shared_keys, *(key for rule in self.rules.values() for key in rule.state_keys))
        return {
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups],
            "params": [local_tensor(p).detach().clone() for p in self._ordered_params()],
            "state": [
                {k: local_tensor(v).clone() for k, v in self.state.get(p, {}).items() if k in keep}
                for p in self._ordered_params()
            ],
        }

    @torch.no_grad()
    def load_replica_state(self, peer: dict[str, Any]) -> None:
        """Take a peer's parameters and shared state; this replica's own momentum stays (see fault_tolerance)."""
        self._pending = None
        if self._store is None:  # not attached yet: each node keeps its own state layout
            self._set_topology(ReplicaTopology.single())
        for group, saved in zip(self.param_groups, peer["groups"]):
            group.update(saved)
        for p, value, state in zip(self._ordered_params(), peer["params"], peer["state"]):
            local_tensor(p).data.copy_(value)
            mine = StateView(self._store, p, local_tensor(p), self.state[p])
            for key, peer_value in state.items():
                if key in self.state[p]:
                    local_tensor(self.state[p][key]).copy_(peer_value)
                elif peer_value.shape == local_tensor(p).shape:  # laid out like the parameter
                    mine.shared(key, lambda v=peer_value: v.clone())
                else:  # a count
                    self.state[p][key] = peer_value.clone()
            self.scheme.healed(local_tensor(p), mine)
        self._verify_state = True

    def _describe_layout(self) -> dict[str, Any]:
        """Settings and shapes every node must share, compared when a node first meets the others."""
        local_only = ("ft_timeout", "quorum_timeout")
        settings = {k: v for k, v in dataclasses.asdict(self.config).items() if k not in local_only}
        return {
            "settings": settings,
            "parameter_shapes": [tuple(p.shape) for p in self._ordered_params()],
            "local_shapes": [tuple(local_tensor(p).shape) for p in self._ordered_params()],
            "processes_per_node": dist.get_world_size() if dist.is_initialized() else 1,
        }

    def _snapshot(self, buckets: list[Bucket], undo_step: bool) -> list:
        """Copies of what a step changes before its exchange, to undo it: the step counts, the state the
        scheme's local maths changes, and the parameters where weight decay or local steps move them."""
        saved = []
        for bucket in buckets:
            tensors = {k: bucket.buffers[k].clone() for k in self.scheme.local_keys if k in bucket.buffers}
            tensors["step"] = bucket.buffers["step"] - (1 if undo_step else 0)  # the counts already moved on
            moved = self.scheme.moves_parameters_locally or bucket.group["weight_decay"] != 0
            saved.append((bucket, bucket.stacked_params() if moved else None, tensors))
        return saved


def restore(saved: list) -> None:
    for bucket, params, tensors in saved:
        if params is not None:
            bucket.copy_to_params(params)
        for key, value in tensors.items():
            bucket.buffers[key].copy_(value)
        bucket.carried = None
