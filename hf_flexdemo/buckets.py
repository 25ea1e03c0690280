"""Buckets: the parameters that one step phase handles together, with their state in one buffer each.

A bucket holds the parameters of one group (so one update rule) that share a layout (whole
shape, placements, local shape) and a dtype. Every step phase (momentum, DCT, top-k, error
feedback, decode, rule) runs once per bucket on ``(count, *shape)`` tensors, so a step launches
work per bucket, not per tensor: OLMo2's 179 tensors fall into 6 buckets at a small width, whatever
the number of layers (11 at OLMo2-1B's width, where the size cap below splits the largest).

The optimizer state stays per parameter (checkpoints keep their keys and layout): each
parameter's entry is a view into the bucket's contiguous buffer for that key. A bucket is
built at the first step and again after the state was replaced (a load, a heal); building
copies whatever state the parameters already hold into the new buffers. :class:`BucketBook` keeps an
optimizer's buckets from step to step and knows when they must be built again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .dtensor_utils import local_tensor
from .state_store import StateStore, StateView


@dataclass
class ParamSlot:
    """One parameter of a bucket: its local shard, its state, and where it sits in the optimizer."""

    param: torch.Tensor
    state: StateView
    group: dict[str, Any]
    """The live parameter group (read for settings that a scheduler does not change: chunk, topk)."""
    index: int
    """Position of the parameter in the optimizer (the same on every replica)."""


@dataclass
class Bucket:
    """Parameters of one group with the same layout and dtype: one step phase acts on all at once.

    ``group``, ``grads`` and ``carried`` belong to one step (see :meth:`for_step`); the buffers
    belong to the bucket and persist across steps.
    """

    slots: list[ParamSlot]
    shape: torch.Size
    """Every parameter's local shape."""
    group: dict[str, Any]
    """The live parameter group; in one step (:meth:`for_step`), a snapshot of it (with overlap, the
    hyperparameters of the step that computed the update)."""
    grads: list[torch.Tensor] | None = None
    """This step's gradients, one per parameter (zeros where a parameter had none); :attr:`grad` stacks them."""
    stacked_grad: torch.Tensor | None = field(default=None, repr=False)
    """:attr:`grad` once made."""
    carried: Any = None
    """What the scheme's ``local_step`` hands to its ``apply`` (None: nothing was sent)."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """State key -> ``(count, *shape)`` (or ``(count,)`` for scalars); each parameter's entry is a view. With
    simulated replicas, per-replica keys hold ``(replicas, count, *shape)``, and each parameter's entry is its
    ``(replicas, *shape)`` view."""
    replicas: int = 1
    """Replicas simulated in this process (``simulate_replicas``): each keeps its own per-replica state."""
    replica: int | None = None
    """In :meth:`for_replica`'s view: the simulated replica whose per-replica state ``buffers`` holds."""
    replica_keys: set[str] = field(default_factory=set)
    """Per-replica state keys (with simulated replicas: the buffers :meth:`for_replica` slices)."""

    @property
    def grad(self) -> torch.Tensor | None:
        """This step's gradients as one ``(count, *shape)`` tensor: a copy, made on first use (the fused encode
        reads :attr:`grads` where they are)."""
        if self.stacked_grad is None and self.grads is not None:
            self.stacked_grad = torch.stack(self.grads)
        return self.stacked_grad

    def release_grads(self) -> None:
        self.grads = self.stacked_grad = None

    @property
    def params(self) -> list[torch.Tensor]:
        return [slot.param for slot in self.slots]

    @property
    def count(self) -> int:
        return len(self.slots)

    @property
    def numel(self) -> int:
        """Entries of one parameter."""
        return math.prod(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.slots[0].param.dtype

    @property
    def device(self) -> torch.device:
        return self.slots[0].param.device

    @property
    def full_shape(self) -> torch.Size:
        """The shape of the whole parameter (a DTensor's global shape; the local one otherwise)."""
        return self.slots[0].state.param.shape

    def for_step(self) -> Bucket:
        """This bucket in one step: a copy of the hyperparameters, no gradients yet, the bucket's buffers."""
        return dataclasses.replace(self, group=dict(self.group), grads=None, stacked_grad=None, carried=None)

    def for_replica(self, replica: int) -> Bucket:
        """This step's bucket as simulated replica ``replica`` sees it: its own slice of each per-replica entry, the
        shared entries as they are."""
        buffers = {key: value[replica] if key in self.replica_keys else value for key, value in self.buffers.items()}
        return dataclasses.replace(self, buffers=buffers, replica=replica, carried=None)

    # -- state -------------------------------------------------------------------------

    def _buffer(
        self,
        key: str,
        dtype: torch.dtype,
        init: Callable[[ParamSlot], torch.Tensor],
        bind: Callable[[StateView, str, torch.Tensor], None],
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is not None:
            return buffer
        assert self.replica is None, f"state {key!r} created in a replica's view"
        # Simulated replicas' per-replica state: one (count, *shape) block per replica, so that each replica's
        # phases run on a contiguous stack; a parameter's entry is its (replicas, *shape) view across the blocks.
        leading = (self.replicas,) if key in self.replica_keys else ()
        buffer = torch.empty((*leading, self.count, *shape), dtype=dtype, device=self.device)
        for i, slot in enumerate(self.slots):
            # State the parameter already holds (loaded, or from before the bucket) moves into the buffer.
            saved = slot.state.read(key) if key in slot.state else init(slot)
            entry = buffer[:, i] if leading else buffer[i]
            entry.copy_(saved.reshape(entry.shape))
            bind(slot.state, key, entry)
        self.buffers[key] = buffer
        return buffer

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[ParamSlot], torch.Tensor]:
        return lambda slot: torch.zeros(shape, dtype=dtype, device=self.device)

    def per_replica(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """State that differs between replicas (momentum), zeros to begin with: ``(count, *shape)``."""
        shape = tuple(self.shape)
        if self.replicas > 1:
            self.replica_keys.add(key)
            init = self._zeros((self.replicas, *shape), dtype)
            return self._buffer(key, dtype, init, StateView.bind_per_replica, shape)
        return self._buffer(key, dtype, self._zeros(shape, dtype), StateView.bind_per_replica, shape)

    def shared(
        self, key: str, dtype: torch.dtype, init: Callable[[ParamSlot], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """State equal on every replica, laid out like the parameter: ``(count, *shape)``; zeros by default."""
        shape = tuple(self.shape)
        return self._buffer(key, dtype, init or self._zeros(shape, dtype), StateView.bind_shared, shape)

    def scalars(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """One number per parameter (a step count), zero to begin with: ``(count,)``; each entry a 0-d view."""
        return self._buffer(key, dtype, self._zeros((), dtype), StateView.bind_plain, ())

    def stacked_params(self) -> torch.Tensor:
        """A copy of the parameters as one ``(count, *shape)`` tensor."""
        return torch.stack(self.params)

    # -- moving the parameters ---------------------------------------------------------

    def unstacked(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``values`` (``count * numel`` entries) as one view per parameter."""
        return list(values.reshape(self.count, *self.shape).unbind(0))

    def copy_to_params(self, values: torch.Tensor) -> None:
        torch._foreach_copy_(self.params, self.unstacked(values.to(self.dtype)))

    def gradients(
        self, zero: bool, source: dict[torch.Tensor, torch.Tensor | None] | None = None
    ) -> list[torch.Tensor]:
        """The gradients, one per parameter (their local tensors); a missing gradient (or every one, ``zero``) counts
        as zeros. ``source``: a simulated replica's gradients by parameter, instead of ``.grad``."""
        grads = []
        for slot in self.slots:
            grad = slot.state.param.grad if source is None else source.get(slot.state.param)
            if grad is not None and grad.is_sparse:
                raise ValueError("FlexDeMo does not support sparse gradients.")
            grads.append(torch.zeros_like(slot.param) if grad is None or zero else local_tensor(grad))
        return grads


MAX_BUCKET_ENTRIES = 2**27
"""A bucket's parameters hold at most this many entries in all (512 MiB of float32; counted whole, not per
shard), or one parameter if that is larger: a phase's temporaries (a stacked gradient, its DCT,
Newton-Schulz's iterates) scale with the bucket, so the largest shapes are handled in a few pieces. 2**28
let OLMo2-1B's step peak at 1.9x its state on a GPU; a bucket this size still takes several layers'
matrices, so the work per launch stays large."""


def build_buckets(
    slots_by_group: list[list[ParamSlot]], max_entries: int = MAX_BUCKET_ENTRIES, replicas: int = 1
) -> list[Bucket]:
    """One bucket per group and parameter layout (in pieces of at most ``max_entries``), in the order of their
    first parameter.

    Decided by the whole parameters (shape, placements), not by this process's shards: every process of a
    node then holds the same buckets (FSDP2's last shards may be shorter), which the orthogonal rule's
    in-node exchange relies on, and every replica builds the same ones.
    """
    buckets: dict[tuple, list[Bucket]] = {}
    for group_index, slots in enumerate(slots_by_group):
        for slot in slots:
            whole, local = slot.state.param, slot.param
            layout = (tuple(whole.shape), tuple(getattr(whole, "placements", ())), tuple(local.shape))
            key = (group_index, layout, local.dtype, local.device)
            pieces = buckets.setdefault(key, [])
            if not pieces or (len(pieces[-1].slots) + 1) * whole.numel() > max_entries:
                pieces.append(Bucket(slots=[], shape=local.shape, group=slot.group, replicas=replicas))
            pieces[-1].slots.append(slot)
    return [bucket for pieces in buckets.values() for bucket in pieces]


def param_slots(
    param_groups: list[dict[str, Any]], state: dict[torch.Tensor, dict], store: StateStore
) -> list[list[ParamSlot]]:
    """Each group's trainable parameters as slots: local shard, state (laid out by ``store``), group, and position
    among all the optimizer's parameters."""
    slots_by_group, index = [], 0
    for group in param_groups:
        slots = []
        for p in group["params"]:
            index += 1
            if p.requires_grad:
                local_p = local_tensor(p)
                slots.append(ParamSlot(local_p, StateView(store, p, local_p, state[p]), group, index))
        slots_by_group.append(slots)
    return slots_by_group


class BucketBook:
    """An optimizer's buckets, kept from step to step, and its step count mirrored on the host.

    Built at the first step, and again when they no longer fit: after the state was replaced (a load or a
    heal sets :attr:`stale`), when a parameter was swapped (Accelerate's prepare), or when a shard's storage
    was replaced (FSDP2 re-sharding after a move), since the buckets' views would update the old tensors.
    """

    def __init__(self) -> None:
        self.buckets: list[Bucket] = []
        self.stale = True
        """Whether the state was replaced: build again, checking the state against this layout (host syncs)."""
        self.host_step: int | None = None
        """Steps taken, mirrored on the host (no sync per step); None: read them from the state again."""
        self._signature: tuple[tuple[int, int], ...] = ()

    def current(self, param_groups: list[dict[str, Any]]) -> list[Bucket] | None:
        """The buckets, if they still fit the parameters and their state; None: build them (then :meth:`keep`)."""
        if self.buckets and not self.stale and _signature(param_groups) == self._signature:
            return self.buckets
        return None

    def forget_step_count(self) -> None:
        """The step counts changed in the state (an undo, a replay): read them again."""
        self.host_step = None

    def forget(self) -> None:
        """The state was replaced (a peer's copy): build the buckets again at the next step."""
        self.stale = True

    def keep(self, buckets: list[Bucket], param_groups: list[dict[str, Any]]) -> list[Bucket]:
        """Keep freshly built buckets, their state created and checked; the step count is read again."""
        self.buckets, self._signature = buckets, _signature(param_groups)
        self.stale, self.host_step = False, None
        return buckets


def _signature(param_groups: list[dict[str, Any]]) -> tuple[tuple[int, int], ...]:
    """Which parameters, in which storage."""
    return tuple((id(p), local_tensor(p).data_ptr()) for group in param_groups for p in group["params"])
