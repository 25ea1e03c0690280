"""Optimizer state laid out so that a distributed checkpoint keeps what differs per replica.

FSDP2 checkpoints go through ``torch.distributed.checkpoint``, which writes a replicated
tensor once and hands it back to every rank on load. FlexDeMo's momentum differs between
replicas by design (error feedback keeps what each node did not send), so it is stored as
one DTensor over the (replicate, shard) mesh with a leading replica dimension: global
shape ``[R, *param.shape]``, placements ``(Shard(0), <param placements shifted by one>)``.
Every replica's slice then has its own offset and comes back to its own process.

Three kinds of state:

- ``per_replica``: differs between replicas (momentum, DiLoCo's inner Adam moments);
- ``shared``: the same on every replica (DiLoCo's anchor and outer momentum): laid out
  like the parameter;
- ``per_rank``: a small vector that differs between every process (byte counters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from .dtensor_utils import contiguous_strides, local_tensor
from .topology import ReplicaTopology


def _shift(placement: Placement) -> Placement:
    return Shard(placement.dim + 1) if isinstance(placement, Shard) else placement


class StateStore:
    """Creates state tensors in the right layout for one replica topology and reads them back."""

    def __init__(self, topology: ReplicaTopology):
        self.topology = topology
        self._meshes: dict[tuple[str, ...], DeviceMesh] = {}

    # -- layouts -----------------------------------------------------------------------

    def _state_mesh(self, param: torch.Tensor) -> DeviceMesh | None:
        """The mesh of ``param``'s own dims with the replicate dim in front (None if not replicated)."""
        topo = self.topology
        if not topo.is_replicated or topo.mesh is None:
            return None
        dims = (topo.replicate_dim, *(param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else ()))
        if dims not in self._meshes:
            self._meshes[dims] = topo.mesh[dims]
        return self._meshes[dims]

    def per_replica(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        mesh = self._state_mesh(param)
        if mesh is None:
            return self.shared(param, local)
        if isinstance(param, DTensor):
            placements = (Shard(0), *(_shift(p) for p in param.placements))
            shape = (self.topology.size, *param.shape)
        else:
            placements, shape = (Shard(0),), (self.topology.size, *local.shape)
        return DTensor.from_local(
            local.unsqueeze(0), mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape)
        )

    def shared(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor):
            return DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        return local

    def per_rank(self, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` is a 1-D vector; every process keeps its own."""
        mesh = self._state_mesh(param)
        if mesh is None and isinstance(param, DTensor):
            mesh = param.device_mesh
        if mesh is None:
            return local
        shape = (*mesh.shape, *local.shape)
        placements = tuple(Shard(i) for i in range(mesh.ndim))
        return DTensor.from_local(
            local.reshape((1,) * mesh.ndim + tuple(local.shape)),
            mesh,
            placements,
            run_check=False,
            shape=shape,
            stride=contiguous_strides(shape),
        )

    # -- reading -----------------------------------------------------------------------

    @staticmethod
    def local(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The local view of per-replica or shared state, shaped like ``like`` (the local parameter)."""
        return local_tensor(value).view(like.shape)


class StateView:
    """One parameter's state, read and created through a :class:`StateStore`."""

    def __init__(self, store: StateStore, param: torch.Tensor, local_param: torch.Tensor, state: dict):
        self.store, self.param, self.local_param, self.raw = store, param, local_param, state

    def _get(
        self, key: str, make: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], init: Callable[[], torch.Tensor]
    ):
        if key not in self.raw:
            self.raw[key] = make(self.param, init())
        return StateStore.local(self.raw[key], self.local_param)

    def per_replica(self, key: str, init: Callable[[], torch.Tensor]) -> torch.Tensor:
        return self._get(key, self.store.per_replica, init)

    def shared(self, key: str, init: Callable[[], torch.Tensor]) -> torch.Tensor:
        return self._get(key, self.store.shared, init)

    def counters(self, key: str, length: int) -> torch.Tensor:
        if key not in self.raw:
            zeros = torch.zeros(length, dtype=torch.int64, device=self.local_param.device)
            self.raw[key] = self.store.per_rank(self.param, zeros)
        return local_tensor(self.raw[key]).view(length)

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def read(self, key: str) -> torch.Tensor:
        """The local values of an existing entry (a parameter-shaped view, or a plain number)."""
        value = local_tensor(self.raw[key])
        return value.view(self.local_param.shape) if value.numel() == self.local_param.numel() else value

    # Binding: make ``local`` (a view into a bucket's buffer) the entry ``key``, in the entry's layout.

    def bind_per_replica(self, key: str, local: torch.Tensor) -> None:
        self.raw[key] = self.store.per_replica(self.param, local)

    def bind_shared(self, key: str, local: torch.Tensor) -> None:
        self.raw[key] = self.store.shared(self.param, local)

    def bind_plain(self, key: str, local: torch.Tensor) -> None:
        self.raw[key] = local


def keep_saved_dtypes(state: dict, saved: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """After torch's ``Optimizer.load_state_dict``, which casts floating state to the parameter's dtype: each entry
    back in the dtype it was saved in (16-bit parameters keep float32 moments)."""
    by_id = {}
    for saved_group, group in zip(saved["param_groups"], param_groups):
        by_id.update(zip(saved_group["params"], group["params"]))
    for pid, saved_state in saved["state"].items():
        p = by_id.get(pid)
        if p is None:
            continue
        for key, value in saved_state.items():
            current = state[p].get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and value.dtype != current.dtype:
                state[p][key] = value.to(device=current.device, copy=True)
