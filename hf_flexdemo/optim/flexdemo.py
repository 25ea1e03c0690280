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
``sign``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..agreement import LOCAL_SETTINGS, check_replicas_agree, group_settings
from ..buckets import MAX_BUCKET_ENTRIES, Bucket, BucketBook, build_buckets, param_slots
from ..config import FlexDeMoConfig, decay_ignored, validate_group, whole_optimizer_setting_in_group
from ..dtensor_utils import local_tensor
from ..fault_tolerance.replica_state import snapshot, undo_local_step
from ..fault_tolerance.rounds import QuorumRounds, StepRound
from ..schemes import Collective, Decoded, StepContext, build_scheme, check_saved_tiles
from ..simulated_replicas import ReplicaGradients, SimulatedTopology, check_simulation_layout
from ..state_store import StateStore, StateView, keep_saved_dtypes
from ..topology import (
    ReplicaTopology,
    check_layout,
    parameter_fingerprint,
    replica_fingerprints,
    start_from_first_replica,
)
from ..updates import (
    UpdateRule,
    build_rules,
    check_saved_elementwise_rule,
    check_saved_rules,
    with_elementwise_groups,
)
from ..wire import CommStats, nbytes
from .counters import COUNTERS, ByteCounters
from .in_flight import EncodedStep, InFlight, split_received, start_exchange

logger = logging.getLogger(__name__)


class FlexDeMo(torch.optim.Optimizer):
    """Decoupled momentum optimizer that replicates compressed momentum across nodes.

    Args:
        params: parameters or parameter groups. Groups may set ``lr``, ``weight_decay``,
            ``decay``, ``topk``, ``chunk``, ``sign``, ``update``, ``betas`` and ``eps``.
        mesh: a :class:`~torch.distributed.device_mesh.DeviceMesh` with a replicate
            dimension (the nodes). Parameters are FSDP2 DTensors on its other dimensions,
            or plain tensors when each replica is a single process. Leave it out for one
            process; with Accelerate or the Trainer, ``hf_flexdemo`` attaches it.
        replicate_dim: the mesh dimension that spans the nodes (default: ``dp_replicate``
            or ``replicate``, whichever the mesh has).
        elementwise: under ``update='orthogonal'`` (the default where it applies), parameters that
            take the adam rule whatever their group says: the embeddings and output heads
            (the Trainer passes them; a plain-PyTorch program passes
            ``hf_flexdemo.elementwise_parameters(model)``). Other rules ignore it: they treat every
            tensor alike.

    The other arguments are described in :class:`hf_flexdemo.FlexDeMoConfig`.

    Contract: every replica must call :meth:`step` the same number of times with the same
    parameters (a parameter without a gradient counts as a zero gradient, so that every
    replica sends the same layout). Replicas start from replica 0's parameters: they are
    compared on the first step and copied if they differ.

    Its parts: the scheme (``scheme``) and the update rules (``rules``) do the maths of a step; the byte
    counters (``counters``) count what crossed nodes; the quorum rounds (``quorum``, fault tolerance) decide how
    each step meets the live nodes. The step itself is one pipeline here: encode, exchange, decode, apply.
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
        """``settings``: the fields of :class:`~hf_flexdemo.FlexDeMoConfig` by name (``lr=3e-4, topk=32``; every one
        with its default and meaning: docs/settings.md). ``mesh`` and ``replicate_dim`` are the device mesh and its
        inter-node dimension (the Accelerate plugin attaches them); ``elementwise`` names the parameters that take
        the adam rule under ``update='orthogonal'`` (embeddings and heads)."""
        self.config = FlexDeMoConfig.from_keywords(settings)
        # A group's sign=False then keeps the sign rule, as sign=False does.
        self._update_unset = settings.get("update") is None
        if self.config.update == "orthogonal":
            if elementwise is None and self._update_unset:
                logger.warning(
                    "FlexDeMo: the default update='orthogonal' orthogonalizes every 2-D parameter's update, embedding "
                    "tables and output heads included; pass elementwise=hf_flexdemo.elementwise_parameters(model) "
                    "(or your model's tables and head) to give those the element-wise rule, as the Trainer does, or "
                    "elementwise=[] if the model has none."
                )
            params = with_elementwise_groups(params, elementwise or (), self.config.elementwise_update)
        super().__init__(params, self.config.group_defaults())
        self.scheme = build_scheme(self.config)
        self.rules = build_rules(self.config)
        self._topology: ReplicaTopology | None = None
        self._store: StateStore | None = None
        self.counters = ByteCounters(self.scheme.collective)
        self.quorum = QuorumRounds(self)  # fault tolerance: how each step meets the live nodes
        self._pending: InFlight | None = None  # overlap: the last step's exchange
        self._book = BucketBook()  # the buckets, built at the first step (see buckets())
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
            self.param_groups[-1],
            scheme=self.config.scheme,
            elementwise_update=self.config.elementwise_update,
        )

    # -- topology ----------------------------------------------------------------------

    def attach(self, mesh: DeviceMesh | None, replicate_dim: str | None = None) -> None:
        """Use ``mesh``'s replicate dimension as the inter-node group; ``None`` means one replica.

        Call it before the first step.
        """
        if any(self.state.values()):
            raise RuntimeError("FlexDeMo.attach() must be called before the first step: state already exists.")
        self._set_topology(ReplicaTopology.single() if mesh is None else ReplicaTopology.from_mesh(mesh, replicate_dim))

    def _set_topology(self, topology: ReplicaTopology) -> None:
        self._topology = topology
        self._store = StateStore(topology)

    @property
    def managed(self):
        """The :class:`~hf_flexdemo.fault_tolerance.ManagedReplicas` this optimizer exchanges through, or None."""
        return self.quorum.managed

    def attach_managed(self, replicas) -> None:
        """Exchange with the live nodes of a torchft quorum (:class:`hf_flexdemo.fault_tolerance.ManagedReplicas`).

        Each node is its own job: parameters are FSDP2-sharded over the node's processes (or
        plain tensors with one process per node), and each node checkpoints its own state.
        Every step joins the quorum (if the caller has not yet, see :meth:`begin_step`), exchanges
        over its live replicas, and applies the update only if the node commits the step.
        """
        if self._topology is not None and self._topology.is_replicated:
            raise RuntimeError(
                "FlexDeMo: attach_managed() on an optimizer that already replicates over a device mesh dimension; "
                "with fault tolerance each node is its own job (one node per launch, no dp_replicate dimension)."
            )
        if self._store is None:
            self._set_topology(ReplicaTopology.single())
        self.quorum.attach(replicas)
        # Through the optimizer's own methods, so that a subclass (or a test's fault injection) serves through its own
        replicas.healing.register("flexdemo_optimizer", self.replica_state, self.load_replica_state)
        replicas.healing.describe("flexdemo", self.quorum.replica.describe_layout)

    def begin_step(self) -> None:
        """Fault tolerance: join this step's quorum now, before the forward pass (no-op otherwise, and with
        ``join_quorum='when_ready'``, which joins in ``step()``).

        A node that is behind then takes a peer's parameters before computing its gradient.
        ``step()`` joins by itself if this was not called, one backward pass later.
        """
        self.quorum.begin_step()

    def finish_training(self) -> None:
        """Under torchft with ``join_quorum='when_ready'``: call once after the last step (the Trainer does).

        The node stays while a live node is still on its last step, so that the late one catches up and every
        node ends on the same parameters (:meth:`~hf_flexdemo.fault_tolerance.ManagedReplicas.close`).
        """
        self.quorum.finish_training()

    def replica_state(self) -> dict[str, Any]:
        """What a peer that is behind needs from this replica (see :meth:`.ReplicaState.serve`)."""
        return self.quorum.replica.serve()

    def load_replica_state(self, peer: dict[str, Any]) -> None:
        """Take a peer's parameters and shared state, or the steps to replay; this replica's own momentum stays."""
        self.quorum.replica.take(peer)

    @property
    def topology(self) -> ReplicaTopology:
        if self.managed is not None:
            return self.managed.topology()
        if self._topology is None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            if world > 1 and self.scheme.collective is not Collective.NONE:
                raise RuntimeError(
                    f"FlexDeMo runs in a job of {world} processes but has no inter-node group, so replicas "
                    "would train unsynchronized. Pass mesh= (a DeviceMesh with a replicate dimension) or call "
                    "optimizer.attach(mesh). With Accelerate or the Trainer, `import hf_flexdemo` before the "
                    "Accelerator is created and the plugin attaches it."
                )
            self._set_topology(ReplicaTopology.single())
        return self._topology

    @property
    def is_attached(self) -> bool:
        return self._topology is not None or self.managed is not None

    @property
    def last_step_stats(self) -> CommStats:
        """The last exchange's inter-node bytes, as the wire counted them."""
        return self.counters.last_step

    @property
    def total_stats(self) -> CommStats:
        """Cumulative inter-node bytes of this process (restored with the optimizer state)."""
        return self.counters.total(self.param_groups, self.state)

    # -- stepping ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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

    @torch.no_grad()
    def flush(self) -> bool:
        """With ``overlap``: wait for the last step's exchange and apply it. Returns whether one was pending."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        self._finish(pending)
        return True

    def _run(self, sync_only: bool) -> bool:
        """One step (``sync_only``: a round of ``synchronize()``); returns whether it exchanged across nodes."""
        if self.quorum.encodes_first(sync_only):
            return self._run_payload_first()
        # Fault tolerance: this step's quorum round (None: nothing to run).
        joined = self.quorum.enter(sync_only=sync_only)
        if joined is None:
            return False
        if self.managed is None:
            self.topology  # noqa: B018  (decides the topology and state layout on first use)
        return self._run_in_round(joined, sync_only=sync_only)

    def _run_in_round(self, joined: StepRound, *, sync_only: bool) -> bool:
        """The step once it knows how it meets the quorum (``joined``)."""
        buckets = self.buckets()
        topology = ReplicaTopology.single() if joined.local else self.topology
        if not sync_only:
            if self._simulated is not None:  # before anything moves: a refused step changes nothing
                self._simulated.check([slot.state.param for bucket in buckets for slot in bucket.slots])
            self.flush()  # overlap: the previous step's update lands before this step's local maths
            self._count_step(buckets)
        if sync_only and not joined.in_quorum and not self.needs_sync():
            return False
        encoded = self._encode_step(
            buckets,
            sync_only=sync_only,
            topology=topology,
            in_quorum=joined.in_quorum,
            drop_gradient=joined.drop_gradient,
        )
        self._send(encoded)
        return encoded.ctx.replicate

    def _run_payload_first(self) -> bool:
        """A training step that encodes, then joins its quorum and exchanges (see
        :meth:`.QuorumRounds.encodes_first`).

        The momentum takes this node's gradient at this node's learning rate, before a catch-up moves the
        hyperparameters on (the exchanged update is applied at the quorum's, as on every node). If the quorum
        turns out to need another payload (its step would not replicate, or a heal copied a peer's state),
        the encoding is undone and the step runs as it would have after joining.
        """
        buckets = self.buckets()
        self._count_step(buckets)
        # The same local part as a step in its round (weight decay waits for the commit: no copy of the parameters)
        encoded = self._encode_step(
            buckets, sync_only=False, topology=self.topology, in_quorum=True, drop_gradient=False
        )
        joined = self.quorum.enter(sync_only=False)
        if joined is None:  # the job finished meanwhile: this gradient would be a step past its end
            undo_local_step(encoded.undo)
            self.forget_step_count()
            return False
        ctx = self._context(self._this_step(), sync_only=False, topology=self.topology)
        if joined.drop_gradient or ctx.replicate != encoded.ctx.replicate:
            if not joined.drop_gradient:  # (a heal that copied a peer's state replaced the encoding with the rest)
                undo_local_step(encoded.undo)
            self.forget_step_count()  # the step counts went back, or are the peer's
            return self._run_in_round(joined, sync_only=False)
        for moving, bucket in zip(encoded.buckets, buckets):  # the quorum's hyperparameters: a heal may have moved
            moving.group = dict(bucket.group)  # them on
        encoded.ctx, encoded.topology = ctx, self.topology  # the quorum's, now that it is known
        self._send(encoded)
        return ctx.replicate

    def _this_step(self) -> int:
        """The step number the replicas pick alike (random's entries, replicate_every's exchanges): steps still
        to replay count."""
        return self.steps_taken() + self.quorum.steps_to_replay()

    def _encode_step(
        self,
        buckets: list[Bucket],
        *,
        sync_only: bool,
        topology: ReplicaTopology,
        in_quorum: bool,
        drop_gradient: bool,
    ) -> EncodedStep:
        """The step's local part, which every path runs: what undoes it (``in_quorum``), weight decay where it
        cannot wait, and each bucket's local maths and payload."""
        step = self._this_step()
        ctx = self._context(step, sync_only=sync_only, topology=topology)
        stepping = [bucket.for_step() for bucket in buckets]
        grads = None  # this process's .grad
        if self._simulated is not None:  # replica 0 runs last, through the same path as a node's step
            topology, grads = self._run_other_replicas(stepping, step, sync_only)
            ctx = self._context(step, sync_only=sync_only, topology=topology)
            stepping = [bucket.for_replica(0) for bucket in stepping]
        # Nothing reads the parameters between here and the rules, so weight decay can wait for them: each rule
        # folds it into its pass over the parameters, and under a quorum it comes after the commit and any
        # catch-up, so undoing the step needs no copy of them. It cannot wait where DiLoCo's inner steps read
        # the parameters, nor with overlap (the rules run at the next step, after its forward).
        overlapped = self.config.overlap and ctx.replicate and not sync_only
        decay_in_rules = not sync_only and not self.scheme.moves_parameters_locally and not overlapped
        undo = None
        if in_quorum:
            undo = snapshot(stepping, self.scheme, undo_step=not sync_only, with_params=not decay_in_rules)
        if not sync_only and not decay_in_rules:
            self.decay(stepping)
        payloads, grad_bytes = self._local_steps(stepping, ctx, sync_only, drop_gradient, grads)
        return EncodedStep(stepping, payloads, grad_bytes, ctx, topology, undo, decay_in_rules, not sync_only)

    def _run_other_replicas(
        self, stepping: list[Bucket], step: int, sync_only: bool
    ) -> tuple[SimulatedTopology, dict | None]:
        """``simulate_replicas``: replicas 1 to R-1 each take their gradient into their own state and post their
        payload to the local collective. Returns replica 0's topology and gradients, for the node's own path."""
        topologies = SimulatedTopology.replicas(self.config.simulate_replicas)
        sources = [None] * len(topologies) if sync_only else self._simulated.for_step()
        for topology, grads in zip(topologies[1:], sources[1:]):
            ctx = self._context(step, sync_only=sync_only, topology=topology)
            replica = [bucket.for_replica(topology.rank) for bucket in stepping]
            payloads, grad_bytes = self._local_steps(replica, ctx, sync_only, False, grads)
            start_exchange(
                self.scheme.collective, replica, payloads, grad_bytes, ctx, async_op=False, topology=topology
            )
        return topologies[0], sources[0]

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

    def _count_step(self, buckets: list[Bucket]) -> None:
        """A training step begins: every bucket's step count moves on."""
        taken = self.steps_taken()
        for bucket in buckets:
            bucket.scalars("step", torch.int64).add_(1)
        self._book.host_step = taken + 1

    def _send(self, step: EncodedStep) -> None:
        """Send the payloads; apply what comes back now, or at the next step with ``overlap``."""
        overlap = self.config.overlap and step.ctx.replicate and step.training
        in_flight = start_exchange(
            self.scheme.collective,
            step.buckets,
            step.payloads,
            step.grad_bytes,
            step.ctx,
            async_op=overlap,
            topology=step.topology,
        )
        in_flight.undo, in_flight.decay_in_rules, in_flight.training = step.undo, step.decay_in_rules, step.training
        if overlap:
            self._pending = in_flight
        else:
            self._finish(in_flight)

    def _context(self, step: int, *, sync_only: bool, topology: ReplicaTopology) -> StepContext:
        ctx = StepContext(
            step=step,
            replicate=self.scheme.is_replication_step(step, forced=sync_only),
            replicas=topology.size,
            rank=topology.rank,
        )
        if self.config.rounding == "stochastic":  # each replica its own draws: rounding errors independent
            ctx.noise = torch.Generator().manual_seed((self.config.seed * 1_000_003 + step) * 1_009 + topology.rank)
        return ctx

    def _local_steps(
        self, stepping: list[Bucket], ctx: StepContext, sync_only: bool, drop_gradient: bool, grads: dict | None = None
    ) -> tuple[list[list[torch.Tensor]], list[int]]:
        """Each bucket's local maths (momentum, encode): its payload, and one gradient's size (the dense baseline).
        ``grads``: a simulated replica's gradients by parameter (None: ``.grad``)."""
        if self.config.traits.outer_steps and not sync_only:
            self._inner_steps(stepping, ctx, drop_gradient, grads)
        payloads, grad_bytes = [], []
        for bucket in stepping:  # one bucket's gradients at a time: they are folded into its state
            bucket.grads = None if sync_only else bucket.gradients(drop_gradient, grads)
            payloads.append(self.scheme.local_step(bucket, ctx))
            grad_bytes.append(nbytes(bucket.grads[0]) if bucket.grads is not None else 0)
            bucket.release_grads()
        return payloads, grad_bytes

    def _inner_steps(self, stepping: list[Bucket], ctx: StepContext, drop_gradient: bool, grads: dict | None) -> None:
        """Outer-step schemes: each bucket's step on this replica's own gradient, before its payload; what the
        scheme leaves to the group's rule (``update='orthogonal'``: the matrices) goes to the rules in batches."""

        def own_updates() -> Iterator[Decoded]:
            for bucket in stepping:
                bucket.grads = bucket.gradients(drop_gradient, grads)
                inner = self.scheme.inner_step(bucket, ctx)
                bucket.release_grads()
                if inner is not None:
                    yield inner

        self._apply_in_batches(own_updates(), ctx)

    def _finish(self, job: InFlight) -> None:
        """Wait for the step's exchange, and apply what came back: decode, then each bucket's update rule."""
        received, stats = job.exchange.wait()
        if job.undo is not None and not self.quorum.commit(job.undo):  # fault tolerance: the node votes
            return  # not committed: the step is undone
        parts = split_received(received, job, self.scheme.collective)
        self.decode_and_apply(job.buckets, parts, job.ctx, decay=job.decay_in_rules)
        if job.undo is not None:
            self.quorum.replica.log(job.buckets, parts, job.ctx, trained=job.training)
        self.counters.count(job, stats)

    # -- the step's parts, for the fault-tolerance rounds (hf_flexdemo.fault_tolerance.pipeline) ----------

    def decay(self, buckets: list[Bucket]) -> None:
        """Weight decay alone, on the buckets' parameters."""
        for bucket in buckets:
            wd = bucket.group["weight_decay"]
            if wd:
                torch._foreach_mul_(bucket.params, 1 - bucket.group["lr"] * wd)

    def decode_and_apply(self, buckets: list[Bucket], parts: list[Any], ctx: StepContext, *, decay: bool) -> None:
        """Decode each bucket's exchange and move its parameters by its rule (``decay``: with weight decay)."""

        def decoded_updates() -> Iterator[Decoded]:
            for bucket, part in zip(buckets, parts):
                decoded = self.scheme.apply(bucket, part, ctx)
                if decoded is None:
                    if decay:  # nothing to apply: the parameters still decay
                        self.decay([bucket])
                    continue
                if decay:
                    decoded.decay = 1 - bucket.group["lr"] * bucket.group["weight_decay"]
                yield decoded

        self._apply_in_batches(decoded_updates(), ctx)

    def _apply_in_batches(self, decoded: Iterable[Decoded], ctx: StepContext) -> None:
        """Decoded updates are dense: the rules take them a few buckets at a time, as they are made, so the step
        holds at most about one bucket's worth beside the state, not the whole model's."""
        batch, entries = [], 0
        for item in decoded:
            batch.append(item)
            entries += item.bucket.count * item.bucket.full_shape.numel()  # whole shapes: a node's processes agree
            if entries >= self.bucket_entries:
                self._apply_rules(batch, ctx)
                batch, entries = [], 0
        self._apply_rules(batch, ctx)

    def _rule(self, group: dict[str, Any]) -> UpdateRule:
        return self.rules[group["update"]]

    def _apply_rules(self, decoded: list[Decoded], ctx: StepContext) -> None:
        """Each rule takes its buckets together (``orthogonal`` moves a node's shards in two all-to-alls)."""
        by_rule: dict[str, list[Decoded]] = {}
        for item in decoded:
            by_rule.setdefault(item.bucket.group["update"], []).append(item)
        for name, items in by_rule.items():
            self.rules[name].apply(items, ctx)

    def steps_taken(self) -> int:
        """Optimizer steps taken, kept on the host (read from the state once per build or undo)."""
        if self._book.host_step is None:
            self._book.host_step = int(self.buckets()[0].scalars("step", torch.int64)[0])
        return self._book.host_step

    def forget_step_count(self) -> None:
        """The step counts changed in the state (an undo, a replay, a peer's copy): read them again."""
        self._book.host_step = None

    def forget_buckets(self) -> None:
        """The state was replaced: build the buckets again at the next step."""
        self._book.stale = True

    def drop_pending(self) -> None:
        """Forget a pending ``overlap`` exchange: the state it refers to is being replaced."""
        self._pending = None

    def state_view(self, param: torch.Tensor) -> StateView:
        """``param``'s state entries, read and created in this optimizer's layout (decided here if not yet: a node
        that is not attached keeps its own)."""
        if self._store is None:
            self._set_topology(ReplicaTopology.single())
        return StateView(self._store, param, local_tensor(param), self.state[param])

    def needs_sync(self) -> bool:
        """Whether ``synchronize()`` has anything to exchange now."""
        first = self.buckets()[0].slots[0]
        return self.scheme.needs_sync(first.state, self.steps_taken())

    def buckets(self) -> list[Bucket]:
        """The buckets of this optimizer's parameters, built when they no longer fit (see :class:`BucketBook`),
        with every state entry created and checked."""
        buckets = self._book.current(self.param_groups)
        if buckets is not None:
            return buckets
        self.counters.flush()  # bytes counted per bucket reach the parameters' counters before rebuilding
        slots_by_group = param_slots(self.param_groups, self.state, self._store)
        all_slots = [slot for slots in slots_by_group for slot in slots]
        if not self._settings_compared and self.managed is None:  # under torchft: when a node meets the others
            described = self.describe_replica() | {"groups": group_settings(self.param_groups)}
            check_replicas_agree(described, self.topology)  # also on a resumed run's first step
            self._settings_compared = True
        if self._simulated is not None:  # also on a resumed run, which skips _start
            params = [slot.state.param for slot in all_slots]
            check_simulation_layout(params, self.topology, self.config.simulate_replicas)
        if "step" not in all_slots[0].state:
            self._start([slot.state.param for slot in all_slots])
        buckets = build_buckets(slots_by_group, self.bucket_entries, self.config.simulate_replicas)
        for bucket in buckets:  # every state entry exists from the first step on (see ReplicationScheme.init_state)
            bucket.scalars("step", torch.int64)
            self.scheme.init_state(bucket)
            if not self.config.traits.outer_steps:  # their inner step keeps its state in the scheme's
                self._rule(bucket.group).init_state(bucket)
            for slot in bucket.slots:
                slot.state.counters(COUNTERS, 2)
                self.scheme.check_state(slot)
                self._rule(bucket.group).check_state(slot)
        if any(bucket.group["update"] == "orthogonal" for bucket in buckets):
            # Under torchft the nodes compare the dtype they took when they meet (no quorum is open here).
            group = self.topology.group if self.managed is None and self.topology.is_replicated else None
            self.rules["orthogonal"].settle_dtype(buckets[0].device, group)
        return self._book.keep(buckets, self.param_groups)

    def _start(self, params: list[torch.Tensor]) -> None:
        """First step: check the layout and that every replica starts from the same parameters."""
        check_layout(params, self._topology or self.topology)
        if self.managed is None:  # under torchft the first quorum copies the first node's state to the others
            start_from_first_replica(params, self.topology)

    def describe_replica(self) -> dict[str, Any]:
        """Settings and shapes every replica must share (see :mod:`hf_flexdemo.agreement`)."""
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        return {
            "settings": {k: v for k, v in dataclasses.asdict(self.config).items() if k not in LOCAL_SETTINGS},
            "parameter_shapes": [tuple(p.shape) for p in params],
            "local_shapes": [tuple(local_tensor(p).shape) for p in params],
            "processes_per_node": dist.get_world_size() if dist.is_initialized() else 1,
        }

    # -- replicas ----------------------------------------------------------------------

    def replica_fingerprints(self) -> list[int]:
        """Checksums of this process's parameter shards on every replica (a collective).

        Under a quorum: on the live replicas that committed the most steps (one that missed a
        commit heals at its next quorum), or ``[]`` if the comparison itself failed.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        if self.managed is not None:
            return self.managed.fingerprints_of_leaders(parameter_fingerprint(params), self.quorum.steps_missed())
        return replica_fingerprints(params, self.topology)

    @property
    def replicas_should_match(self) -> bool:
        """Whether, by the scheme's design, replicas hold identical parameters right now."""
        first = next((p for group in self.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None or "step" not in self.state.get(first, {}):
            return True
        slot = self.buckets()[0].slots[0]
        return self.scheme.replicas_match(slot.state, self.steps_taken())

    # -- state dict --------------------------------------------------------------------

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
        self._book.stale = True
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch takes the saved groups' keys; older checkpoints lack this one
            group.setdefault("update", "sign")
        keep_saved_dtypes(self.state, state_dict, self.param_groups)


def unwrap_flexdemo(optimizer) -> FlexDeMo | None:
    """The FlexDeMo behind ``optimizer`` (Accelerate's wrapper keeps it as ``.optimizer``), or None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, FlexDeMo) else None
