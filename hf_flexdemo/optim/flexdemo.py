"""FlexDeMo: decoupled momentum optimization for fully and hybrid sharded training.

Inside a node, FSDP2 shards the model and averages gradients; across nodes only what the
replication scheme picks travels. Per parameter and step (``demo`` scheme)::

    m   = decay * m + lr * grad                      local momentum, never all-reduced
    q   = top-k DCT coefficients of m (per tile)     the fast-moving components
    m  -= IDCT(q)                                    error feedback
    u   = IDCT(mean over replicas of q)              one packed all-gather per step
    p  *= 1 - lr * weight_decay                      decoupled weight decay (in the rule's pass)
    p  -= lr * step(u)                               the group's update rule

The replication step is pluggable (:mod:`hf_flexdemo.schemes`: ``demo``, ``random``,
``striding``, ``diloco``, ``sparseloco``, ``full`` and ``none``), and so is the update rule
(:mod:`hf_flexdemo.updates`: ``orthogonal`` with ``adam`` for the rest by default, ``adam``,
``sign``). A step is one path: :meth:`FlexDeMo.begin`, :meth:`~FlexDeMo.encode` (the local part),
:meth:`~FlexDeMo.send` (the exchange starts), :meth:`~FlexDeMo.finish` (wait, decode, apply).
Fault tolerance wraps that path (:mod:`hf_flexdemo.fault_tolerance`); this module knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..agreement import LOCAL_SETTINGS, check_replicas_agree, group_settings
from ..buckets import MAX_BUCKET_ENTRIES, Bucket, BucketBook, build_buckets, param_slots
from ..config import FlexDeMoConfig, decay_ignored, validate_group, whole_optimizer_setting_in_group
from ..dtensor_utils import local_tensor
from ..schemes import Collective, build_scheme, check_saved_tiles
from ..simulated_replicas import ReplicaGradients, check_simulation_layout
from ..state_store import StateStore, keep_saved_dtypes
from ..topology import ReplicaTopology, check_layout, replica_fingerprints, start_from_first_replica
from ..updates import build_rules, check_saved_elementwise_rule, check_saved_rules, with_elementwise_groups
from ..wire import CommStats
from .apply_rules import RuleApplier, weight_decay
from .counters import COUNTERS, ByteCounters
from .in_flight import UNGUARDED, EncodedStep, InFlight, StepGuard, split_received, start_exchange
from .local_step import local_payloads, other_replicas_step, step_context

logger = logging.getLogger(__name__)


class StepWrapper(Protocol):
    """What runs this optimizer's steps inside its own rounds (:func:`hf_flexdemo.fault_tolerance.wrap_optimizer`),
    through :meth:`FlexDeMo.begin`, :meth:`~FlexDeMo.encode`, :meth:`~FlexDeMo.send` and :meth:`~FlexDeMo.finish`."""

    def run(self, sync_only: bool) -> bool:
        """One step (or a round of ``synchronize()``); whether it exchanged across nodes."""

    def topology(self) -> ReplicaTopology:
        """The replicas this step exchanges with."""

    def fingerprints(self, params: list[torch.Tensor]) -> list[int]:
        """Checksums of ``params`` on the replicas that should hold them alike."""


def _with_elementwise_groups(params, elementwise, config: FlexDeMoConfig, *, warn: bool):
    """Under ``update='orthogonal'``: the ``elementwise`` parameters in groups of their own, with the adam rule."""
    if elementwise is None and warn:
        logger.warning(
            "FlexDeMo: the default update='orthogonal' orthogonalizes every 2-D parameter's update, embedding "
            "tables and output heads included; pass elementwise=hf_flexdemo.elementwise_parameters(model) "
            "(or your model's tables and head) to give those the element-wise rule, as the Trainer does, or "
            "elementwise=[] if the model has none."
        )
    return with_elementwise_groups(params, elementwise or (), config.elementwise_update)


def _create_state(buckets: list[Bucket], scheme, rules: dict, config: FlexDeMoConfig, group) -> None:
    """Every state entry of every bucket, created and checked (see ReplicationScheme.init_state); ``group``: the
    process group that settles the orthogonal rule's dtype (None: this process decides)."""
    for bucket in buckets:
        bucket.scalars("step", torch.int64)
        scheme.init_state(bucket)
        rule = rules[bucket.group["update"]]
        if not config.traits.outer_steps:  # their inner step keeps its state in the scheme's
            rule.init_state(bucket)
        for slot in bucket.slots:
            slot.state.counters(COUNTERS, 2)
            scheme.check_state(slot)
            rule.check_state(slot)
    if any(bucket.group["update"] == "orthogonal" for bucket in buckets):
        rules["orthogonal"].settle_dtype(buckets[0].device, group)


def _unwrapped_refusal(config: FlexDeMoConfig) -> str:
    return (
        f"FlexDeMo: fault_tolerance={config.fault_tolerance!r} but no node wraps this optimizer, so it would train "
        "alone. The Trainer and Accelerate wrap it; in your own loop call hf_flexdemo.fault_tolerance."
        "wrap_optimizer(optimizer, hf_flexdemo.fault_tolerance.node_replicas(optimizer.config))."
    )


def _no_group_refusal(world: int) -> str:
    return (
        f"FlexDeMo runs in a job of {world} processes but has no inter-node group, so replicas would train "
        "unsynchronized. Pass mesh= (a DeviceMesh with a replicate dimension) or call optimizer.attach(mesh). With "
        "Accelerate or the Trainer, `import hf_flexdemo` before the Accelerator is created and the plugin attaches it."
    )


class FlexDeMo(torch.optim.Optimizer):
    """Decoupled momentum optimizer that replicates compressed momentum across nodes.

    ``mesh``: a :class:`~torch.distributed.device_mesh.DeviceMesh` whose ``replicate_dim`` (default ``dp_replicate``
    or ``replicate``) spans the nodes; parameters are FSDP2 DTensors on its other dimensions, or plain tensors with
    one process per node. Leave it out for one process: with Accelerate or the Trainer, ``hf_flexdemo`` attaches it.
    ``elementwise``: under ``update='orthogonal'``, the parameters that take the adam rule (embeddings and heads:
    ``hf_flexdemo.elementwise_parameters(model)``; the Trainer passes them). Groups may set ``lr``,
    ``weight_decay``, ``decay``, ``topk``, ``chunk``, ``sign``, ``update``, ``betas`` and ``eps``; every other
    setting is a field of :class:`hf_flexdemo.FlexDeMoConfig` (docs/settings.md).

    Contract: every replica calls :meth:`step` as often, with the same parameters (one without a gradient counts
    as a zero gradient). Replicas start from replica 0's parameters, compared at the first step.

    Its parts: the scheme (``scheme``) and the update rules (``rules``, applied by ``applier``) do the maths;
    ``counters`` count what crossed nodes; ``wrapped_by`` (fault tolerance) runs the steps inside its rounds.
    """

    bucket_entries: int = MAX_BUCKET_ENTRIES
    """Most entries per bucket, and per batch of decoded updates handed to the rules: what bounds the step's
    temporaries (a class attribute, so every process of a job agrees)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        mesh: DeviceMesh | None = None,
        replicate_dim: str | None = None,
        elementwise: Iterable[torch.Tensor] | None = None,
        **settings: Any,
    ):
        self.config = FlexDeMoConfig.from_keywords(settings)
        self._update_unset = settings.get("update") is None  # a group's sign=False then keeps the sign rule
        if self.config.update == "orthogonal":
            params = _with_elementwise_groups(params, elementwise, self.config, warn=self._update_unset)
        super().__init__(params, self.config.group_defaults())
        self.scheme = build_scheme(self.config)
        self.rules = build_rules(self.config)
        self.applier = RuleApplier(self.scheme, self.rules, lambda: self.bucket_entries)
        self.counters = ByteCounters(self.scheme.collective)
        self.book = BucketBook()  # the buckets, built at the first step (see buckets())
        self.store: StateStore | None = None  # the state's layout over the replicas, decided with the topology
        self.wrapped_by: StepWrapper | None = None
        self._topology: ReplicaTopology | None = None
        self._pending: InFlight | None = None  # overlap: the last step's exchange
        self._settings_compared = False  # with the other replicas', at this process's first step
        replicas = self.config.simulate_replicas
        self._simulated = ReplicaGradients(replicas) if replicas > 1 else None  # simulate_replicas' gradients
        if mesh is not None:
            self.attach(mesh, replicate_dim)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        refusal = whole_optimizer_setting_in_group(param_group)
        if refusal:
            raise ValueError(refusal)
        if "decay" in param_group and param_group["decay"] is None:  # unset, as FlexDeMo(decay=None) is
            param_group = {key: value for key, value in param_group.items() if key != "decay"}
        if "decay" in param_group and self.config.traits.outer_steps:
            raise ValueError(decay_ignored(param_group["decay"], self.config.scheme, " in a parameter group"))
        if "update" not in param_group and param_group.get("sign") is False and self._update_unset:
            param_group = {**param_group, "update": "sign"}  # the raw decoded update: the sign rule's variant
        super().add_param_group(param_group)
        validate_group(
            self.param_groups[-1], scheme=self.config.scheme, elementwise_update=self.config.elementwise_update
        )

    def attach(self, mesh: DeviceMesh | None, replicate_dim: str | None = None) -> None:
        """Use ``mesh``'s replicate dimension as the inter-node group; ``None`` means one replica.

        Call it before the first step.
        """
        if any(self.state.values()):
            raise RuntimeError("FlexDeMo.attach() must be called before the first step: state already exists.")
        self._topology = ReplicaTopology.single() if mesh is None else ReplicaTopology.from_mesh(mesh, replicate_dim)
        self.store = StateStore(self._topology)

    @property
    def topology(self) -> ReplicaTopology:
        if self.wrapped_by is not None:
            return self.wrapped_by.topology()
        if self._topology is None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if world > 1 and self.scheme.collective is not Collective.NONE:
                raise RuntimeError(_no_group_refusal(world))
            self._topology = ReplicaTopology.single()  # one replica; a state loaded before the first step fits it
            self.store = StateStore(self._topology)
        return self._topology

    @property
    def last_step_stats(self) -> CommStats:
        """The last exchange's inter-node bytes, as the wire counted them."""
        return self.counters.last_step

    @property
    def total_stats(self) -> CommStats:
        """Cumulative inter-node bytes of this process (restored with the optimizer state)."""
        return self.counters.total(self.param_groups, self.state)

    # -- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self._run(sync_only=False)
        return loss

    @torch.no_grad()
    def synchronize(self) -> bool:
        """Bring replicas to the same parameters now; returns whether anything was exchanged.

        Applies a pending ``overlap`` exchange, and for DiLoCo runs an outer step unless one
        ran at this step. Call it on every process at the same point, for example before
        saving a checkpoint, before evaluating, or at the end of training.
        """
        flushed = self.flush()
        return self._run(sync_only=True) or flushed

    def _run(self, sync_only: bool) -> bool:
        """One step (``sync_only``: a round of ``synchronize()``); whether it exchanged across nodes."""
        if self.wrapped_by is not None:  # the same path, inside the wrapper's rounds
            return self.wrapped_by.run(sync_only)
        if self.config.fault_tolerant:
            raise RuntimeError(_unwrapped_refusal(self.config))
        buckets = self.begin(sync_only)
        return buckets is not None and self.send(self.encode(buckets, sync_only=sync_only, topology=self.topology))

    def begin(self, sync_only: bool, *, must_run: bool = False) -> list[Bucket] | None:
        """The buckets of a step that runs (a training step lands a pending ``overlap`` exchange, then counts itself),
        or None: no trainable parameter, or a ``synchronize()`` with nothing to exchange (unless ``must_run``)."""
        if not any(p.requires_grad for group in self.param_groups for p in group["params"]):
            return None
        buckets = self.buckets()
        if sync_only:
            return buckets if must_run or self.needs_sync() else None
        if self._simulated is not None:  # before anything moves: a refused step changes nothing
            self._simulated.check([slot.state.param for bucket in buckets for slot in bucket.slots])
        self.flush()
        self.book.host_step = self.steps_taken() + 1  # read before the counts move on
        for bucket in buckets:
            bucket.scalars("step", torch.int64).add_(1)
        return buckets

    def encode(self, buckets: list[Bucket], *, sync_only: bool, topology: ReplicaTopology, step: int | None = None,
               drop_gradient: bool = False, guard=None) -> EncodedStep:  # fmt: skip
        """The step's local part: each bucket's momentum and payload. ``step``: its number if not the next;
        ``guard(stepping, sync_only, decay_in_rules)`` makes the :class:`StepGuard`, before anything changes."""
        step, grads = self.steps_taken() if step is None else step, None  # grads None: this process's .grad
        stepping = [bucket.for_step() for bucket in buckets]
        if self._simulated is not None:  # replicas 1 to R-1 first; replica 0 through a node's own path
            topology, grads = other_replicas_step(self.config, self.applier, self._simulated, stepping, step, sync_only)
            stepping = [bucket.for_replica(0) for bucket in stepping]
        ctx = step_context(self.config, self.scheme, step, sync_only=sync_only, topology=topology)
        # Weight decay waits for the rules' pass, after the guard, unless inner steps or overlap's late rules forbid it
        overlapped = self.config.overlap and ctx.replicate
        decay_in_rules = not sync_only and not self.scheme.moves_parameters_locally and not overlapped
        held: StepGuard = UNGUARDED if guard is None else guard(stepping, sync_only, decay_in_rules)
        if not sync_only and not decay_in_rules:
            weight_decay(stepping)
        payloads, grad_bytes = local_payloads(self.applier, stepping, ctx, sync_only=sync_only,
                                              drop_gradient=drop_gradient, grads=grads)  # fmt: skip
        return EncodedStep(stepping, payloads, grad_bytes, ctx, topology, held, decay_in_rules, not sync_only)

    def send(self, step: EncodedStep) -> bool:
        """Start the exchange; apply it now, or at the next step with ``overlap``. Whether it crossed nodes."""
        overlap = self.config.overlap and step.ctx.replicate and step.training
        job = start_exchange(self.scheme.collective, step.buckets, step.payloads, step.grad_bytes, step.ctx,
                             async_op=overlap, topology=step.topology)  # fmt: skip
        job.guard, job.decay_in_rules, job.training = step.guard, step.decay_in_rules, step.training
        if overlap:
            self._pending = job
        else:
            self.finish(job)
        return step.ctx.replicate

    def finish(self, job: InFlight) -> None:
        """Wait for the step's exchange, then decode what came back and apply each bucket's update rule."""
        received, stats = job.exchange.wait()
        if not job.guard.settle():
            return  # the guard undid the step
        parts = split_received(received, job, self.scheme.collective)
        self.applier.decode_and_apply(job.buckets, parts, job.ctx, decay=job.decay_in_rules)
        job.guard.applied(job, parts)
        self.counters.count(job, stats)

    @torch.no_grad()
    def flush(self) -> bool:
        """With ``overlap``: apply the last step's exchange (before this step's local maths); whether one was."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.finish(pending)
        return pending is not None

    # -- state -----------------------------------------------------------------------------

    def steps_taken(self) -> int:
        """Optimizer steps taken, kept on the host (read from the state once per build or undo)."""
        if self.book.host_step is None:
            self.book.host_step = int(self.buckets()[0].scalars("step", torch.int64)[0])
        return self.book.host_step

    def needs_sync(self) -> bool:
        """Whether ``synchronize()`` has anything to exchange now."""
        return self.scheme.needs_sync(self.buckets()[0].slots[0].state, self.steps_taken())

    def buckets(self) -> list[Bucket]:
        """The buckets of this optimizer's parameters, built when they no longer fit (see :class:`BucketBook`),
        with every state entry created and checked."""
        buckets = self.book.current(self.param_groups)
        if buckets is not None:
            return buckets
        self.counters.flush()  # bytes counted per bucket reach the parameters' counters before rebuilding
        alone = self.wrapped_by is None  # a wrapper compares and copies when its node meets the others
        topology = self.topology if alone else self._topology  # decided here if not yet; a wrapper's: this node's
        slots_by_group = param_slots(self.param_groups, self.state, self.store)
        all_slots = [slot for slots in slots_by_group for slot in slots]
        params, first_slot = [slot.state.param for slot in all_slots], all_slots[0]
        if not self._settings_compared and alone:
            described = self.describe_replica() | {"groups": group_settings(self.param_groups)}
            check_replicas_agree(described, topology)  # also on a resumed run's first step
            self._settings_compared = True
        if self._simulated is not None:  # also on a resumed run, which skips the first step's checks
            check_simulation_layout(params, topology, self.config.simulate_replicas)
        if "step" not in first_slot.state:  # the first step: one layout, replica 0's parameters
            check_layout(params, topology)
            if alone:
                start_from_first_replica(params, topology)
        buckets = build_buckets(slots_by_group, self.bucket_entries, self.config.simulate_replicas)
        group = topology.group if alone and topology.is_replicated else None  # a wrapper's nodes compare the dtype
        _create_state(buckets, self.scheme, self.rules, self.config, group)
        return self.book.keep(buckets, self.param_groups)

    def describe_replica(self) -> dict[str, Any]:
        """Settings and shapes every replica must share (see :mod:`hf_flexdemo.agreement`)."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        return {
            "settings": {k: v for k, v in dataclasses.asdict(self.config).items() if k not in LOCAL_SETTINGS},
            "parameter_shapes": [tuple(p.shape) for p in params],
            "local_shapes": [tuple(local_tensor(p).shape) for p in params],
            "processes_per_node": dist.get_world_size() if dist.is_initialized() else 1,
        }

    def state_dict(self) -> dict[str, Any]:
        self.flush()  # a pending overlap exchange belongs to the state being saved
        self.counters.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_saved_rules(state_dict["param_groups"], self.param_groups)
        if self.config.traits.top_k:
            check_saved_tiles(state_dict["param_groups"], self.param_groups, self.config.wire)
        if not self.config.traits.outer_steps:  # their inner step's state is the scheme's
            check_saved_elementwise_rule(state_dict, self.param_groups)
        self._pending = None  # an exchange started before loading refers to the replaced state
        if self._simulated is not None:
            self._simulated.clear()  # gradients taken before the load belong to the replaced run
        self.counters.forget()  # so do bytes not yet added to it
        self.book.stale = True
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch takes the saved groups' keys; older checkpoints lack this one
            group.setdefault("update", "sign")
        keep_saved_dtypes(self.state, state_dict, self.param_groups)

    # -- replicas --------------------------------------------------------------------------

    def next_replica(self) -> None:
        """``simulate_replicas``: the gradients in ``.grad`` are the current replica's; the next backward fills the
        next replica's. Call it after each replica's backward but the last (the Trainer's callback does)."""
        if self._simulated is None:
            raise RuntimeError(
                "FlexDeMo.next_replica() belongs to simulate_replicas=R (R > 1), which this optimizer does not set."
            )
        self._simulated.take([p for group in self.param_groups for p in group["params"] if p.requires_grad])

    @property
    def replica_gradients(self) -> list[dict[torch.Tensor, torch.Tensor | None]]:
        """``simulate_replicas``: the gradients :meth:`next_replica` took this step, one dict per replica (by
        parameter), for a caller that scales or clips them before :meth:`step` (the Trainer's callback does)."""
        return self._simulated.banked if self._simulated is not None else []

    def replica_fingerprints(self) -> list[int]:
        """Checksums of this process's parameter shards on every replica (a collective); under a wrapper, on the
        replicas it says should match (``[]`` if the comparison itself failed)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if self.wrapped_by is not None:
            return self.wrapped_by.fingerprints(params)
        return replica_fingerprints(params, self.topology)

    @property
    def replicas_should_match(self) -> bool:
        """Whether, by the scheme's design, replicas hold identical parameters right now."""
        first = next((p for group in self.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None or "step" not in self.state.get(first, {}):
            return True
        return self.scheme.replicas_match(self.buckets()[0].slots[0].state, self.steps_taken())


def unwrap_flexdemo(optimizer) -> FlexDeMo | None:
    """The FlexDeMo behind ``optimizer`` (Accelerate's wrapper keeps it as ``.optimizer``), or None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, FlexDeMo) else None
