"""FlexDeMo: decoupled momentum optimization for fully and hybrid sharded training.

Inside a node, FSDP2 shards the model and averages gradients; across nodes only what the
replication scheme picks travels. Per parameter and step (``demo`` scheme)::

    p  *= 1 - lr * weight_decay                      decoupled weight decay
    m   = decay * m + lr * grad                      local momentum, never all-reduced
    q   = top-k DCT coefficients of m (per tile)     the fast-moving components
    m  -= IDCT(q)                                    error feedback
    u   = IDCT(mean over replicas of q)              one packed all-gather per step
    p  -= lr * step(u)                               the group's update rule

The replication step is pluggable (:mod:`hf_flexdemo.schemes`: ``demo``, ``random``,
``striding``, ``diloco``, ``sparseloco``, ``full`` and ``none``), and so is the update rule
(:mod:`hf_flexdemo.updates`: ``orthogonal`` with ``adam`` for the rest by default, ``adam``,
``sign``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..buckets import MAX_BUCKET_ENTRIES, Bucket, BucketBook, build_buckets, param_slots
from ..config import REPLAYABLE_SCHEMES, FlexDeMoConfig, validate_group
from ..dtensor_utils import local_tensor
from ..schemes import Collective, Decoded, StepContext, build_scheme
from ..state_store import StateStore
from ..topology import (
    ReplicaTopology,
    broadcast_from_first_replica,
    check_layout,
    parameter_fingerprint,
    replica_fingerprints,
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
from .in_flight import InFlight, split_received, start_exchange
from .replay import LoggedStep, ReplayLog
from .replica_state import ReplicaState, restore

logger = logging.getLogger(__name__)


class FlexDeMo(ByteCounters, ReplicaState, torch.optim.Optimizer):
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
            take ``elementwise_update`` whatever their group says: the embeddings and output heads
            (the Trainer passes them; a plain-PyTorch program passes
            ``hf_flexdemo.elementwise_parameters(model)``). Other rules ignore it: they treat every
            tensor alike.

    The other arguments are described in :class:`hf_flexdemo.FlexDeMoConfig`.

    Contract: every replica must call :meth:`step` the same number of times with the same
    parameters (a parameter without a gradient counts as a zero gradient, so that every
    replica sends the same layout). Replicas start from replica 0's parameters: they are
    compared on the first step and copied if they differ.
    """

    bucket_entries: int = MAX_BUCKET_ENTRIES
    """Most entries per bucket, and per batch of decoded updates handed to the rules: what bounds the step's
    temporaries (a class attribute, so every process of a job agrees)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        decay: float = 0.999,
        topk: int = 32,
        chunk: int = 64,
        sign: bool = True,
        *,
        update: str | None = None,
        elementwise_update: str | None = None,
        ns_dtype: str = "auto",
        decode: str = "selected",
        value_dtype: str = "param",
        scheme: str = "demo",
        replicate_every: int = 1,
        rate: float = 1 / 128,
        seed: int = 0,
        inner_steps: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        overlap: bool = False,
        value_bits: int = 0,
        pack_indices: bool = False,
        rounding: str = "nearest",
        shared_indices: bool = False,
        kernels: str = "torch",
        fault_tolerance: str = "off",
        min_replicas: int = 1,
        ft_timeout: float = 30.0,
        quorum_timeout: float = 120.0,
        replay_steps: int = 4,
        join_quorum: str = "before_forward",
        mesh: DeviceMesh | None = None,
        replicate_dim: str | None = None,
        elementwise: Iterable[torch.Tensor] | None = None,
    ):
        self.config = FlexDeMoConfig(
            lr=lr,
            weight_decay=weight_decay,
            decay=decay,
            topk=topk,
            chunk=chunk,
            sign=sign,
            update=update,
            elementwise_update=elementwise_update,
            ns_dtype=ns_dtype,
            decode=decode,
            value_dtype=value_dtype,
            scheme=scheme,
            replicate_every=replicate_every,
            rate=rate,
            seed=seed,
            inner_steps=inner_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            betas=betas,
            eps=eps,
            overlap=overlap,
            value_bits=value_bits,
            pack_indices=pack_indices,
            rounding=rounding,
            shared_indices=shared_indices,
            kernels=kernels,
            fault_tolerance=fault_tolerance,
            min_replicas=min_replicas,
            ft_timeout=ft_timeout,
            quorum_timeout=quorum_timeout,
            replay_steps=replay_steps,
            join_quorum=join_quorum,
        )
        self._update_unset = update is None  # a group's sign=False then keeps the sign rule, as sign=False does
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
        self.last_step_stats = CommStats()
        self._pending: InFlight | None = None  # overlap: the last step's exchange
        self._uncounted: dict[int, list] = {}  # per bucket: [slots, bytes sent, dense bytes] not yet in the state
        self._book = BucketBook()  # the buckets, built at the first step (see _bucketed)
        self._managed = None  # fault tolerance: the ManagedReplicas that decide who the replicas are each step
        replayable = self.config.fault_tolerant and self.config.scheme in REPLAYABLE_SCHEMES
        self._replay = ReplayLog(self.config.replay_steps if replayable else 0)  # steps a lagging peer may replay
        self._missed: list[LoggedStep] | None = None  # steps this node missed, replayed at its next commit
        if mesh is not None:
            self.attach(mesh, replicate_dim)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "elementwise_update" in param_group:
            raise ValueError(
                f"FlexDeMo: elementwise_update={param_group['elementwise_update']!r} in a parameter group; it holds "
                "for the whole optimizer: pass it to FlexDeMo(...) (or optim_args), or give the group its own "
                "update='adam' or 'sign'."
            )
        if "update" not in param_group and param_group.get("sign") is False and self._update_unset:
            param_group = {**param_group, "update": "sign"}  # the raw decoded update: the sign rule's variant
        super().add_param_group(param_group)
        validate_group(
            self.param_groups[-1], scheme=self.config.scheme, elementwise_update=self.config.elementwise_update
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

    def attach_managed(self, replicas) -> None:
        """Exchange with the live nodes of a torchft quorum (:class:`hf_flexdemo.fault_tolerance.ManagedReplicas`).

        Each node is its own job: parameters are FSDP2-sharded over the node's processes (or
        plain tensors with one process per node), and each node checkpoints its own state.
        Every step joins the quorum (if the caller has not yet, see ``begin()``), exchanges
        over its live replicas, and applies the update only if the node commits the step.
        """
        if self._topology is not None and self._topology.is_replicated:
            raise RuntimeError(
                "FlexDeMo: attach_managed() on an optimizer that already replicates over a device mesh dimension; "
                "with fault tolerance each node is its own job (one node per launch, no dp_replicate dimension)."
            )
        if self._store is None:
            self._set_topology(ReplicaTopology.single())
        self._managed = replicas
        replicas.register("flexdemo_optimizer", self.replica_state, self.load_replica_state)
        replicas.describe("flexdemo", self._describe_layout)

    @property
    def topology(self) -> ReplicaTopology:
        if self._managed is not None:
            return self._managed.topology()
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
        return self._topology is not None or self._managed is not None

    @property
    def managed(self):
        """The :class:`~hf_flexdemo.fault_tolerance.ManagedReplicas` this optimizer exchanges through, or None."""
        return self._managed

    def begin_step(self) -> None:
        """Fault tolerance: join this step's quorum now, before the forward pass (no-op otherwise, and with
        ``join_quorum='when_ready'``, which joins in ``step()``).

        A node that is behind then takes a peer's parameters before computing its gradient.
        ``step()`` joins by itself if this was not called, one backward pass later.
        """
        if self._managed is not None and self.config.join_quorum == "before_forward":
            self._managed.begin()

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
        managed = self._managed
        if self.config.fault_tolerant and managed is None:
            raise RuntimeError(
                "FlexDeMo: fault_tolerance='torchft' but no quorum is attached, so this node would train alone. "
                "The Trainer and Accelerate attach it; in your own loop call "
                "optimizer.attach_managed(hf_flexdemo.fault_tolerance.node_replicas(optimizer.config))."
            )
        first = next((p for group in self.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None:
            return False
        creating_state = (
            managed is not None
            and not managed.round_open
            and not any(self.state.values())
            and self._is_state_creation()
        )
        if managed is None:
            self.topology  # noqa: B018  (decides the topology and state layout on first use)
        in_round = managed is not None and not creating_state
        if in_round and sync_only and self.config.join_quorum == "when_ready" and not self._needs_sync():
            # Nothing to exchange, so no round: a node late for a quorum could otherwise meet this round with
            # its training step, whose collectives are not this round's. It catches up at a training step.
            return False
        healed_now = False
        if in_round:
            if sync_only and "step" not in self.state.get(first, {}):
                return False  # nothing trained yet
            # The round may open here, after the backward pass, and replace the parameters: this
            # gradient then belongs to the old ones, so the step folds in nothing.
            healed_now = managed.begin() and not sync_only
            if self.config.join_quorum == "when_ready" and managed.agree_on_finished():
                # This node healed from one that finished training: the job's last step has committed. It
                # catches up to it and finishes too; its own gradient would be a step past the end.
                self._closing_round()
                return False
        buckets = self._bucketed()
        if in_round and sync_only and not self._needs_sync():
            # Decided after healing, so every node decides alike; the round closes with nothing sent.
            self._empty_round()
            return False
        topology = ReplicaTopology.single() if creating_state else self.topology
        if not sync_only:
            self.flush()  # overlap: the previous step's update lands before this step's local maths
            taken = self._steps_taken()
            for bucket in buckets:
                bucket.scalars("step", torch.int64).add_(1)
            self._book.host_step = taken + 1
        # Steps still to replay count: the step number picks random's entries and replicate_every's exchanges,
        # which every replica of the quorum must pick alike.
        step = self._steps_taken() + self._steps_to_replay()
        if sync_only and not in_round and not self._needs_sync():
            return False
        ctx = StepContext(
            step=step,
            replicate=self.scheme.is_replication_step(step, forced=sync_only),
            replicas=topology.size,
            rank=topology.rank,
        )
        if self.config.rounding == "stochastic":  # each replica its own draws: rounding errors independent
            ctx.noise = torch.Generator().manual_seed((self.config.seed * 1_000_003 + step) * 1_009 + topology.rank)
        stepping = [bucket.for_step(None) for bucket in buckets]
        undo = self._snapshot(stepping, undo_step=not sync_only) if in_round else None
        # Nothing reads the parameters between here and the rules, so under a quorum weight decay can wait
        # for the commit, after any catch-up (DiLoCo's inner steps do read them: it decays now).
        decay_on_commit = in_round and not sync_only and not self.scheme.moves_parameters_locally
        if not sync_only and not decay_on_commit:
            self._decay(stepping)
        # A gradient taken on parameters that a heal replaced, or that a catch-up will move, folds in nothing;
        # but a node that joins when ready is late on purpose: its gradient counts, at most replay_steps old.
        late_but_counted = self.config.join_quorum == "when_ready" and self._missed is not None
        stale = (healed_now or self._missed is not None) and not late_but_counted
        payloads, grad_bytes = [], []
        for bucket in stepping:  # one bucket's stacked gradients at a time: they are folded into its state
            bucket.grad = None if sync_only else bucket.stacked_grads(stale)
            payloads.append(self.scheme.local_step(bucket, ctx))
            grad_bytes.append(nbytes(bucket.grad) // bucket.count if bucket.grad is not None else 0)
            bucket.grad = None
        overlap = self.config.overlap and ctx.replicate and not sync_only
        in_flight = start_exchange(
            self.scheme.collective, stepping, payloads, grad_bytes, ctx, async_op=overlap, topology=topology
        )
        in_flight.undo, in_flight.decay_on_commit, in_flight.training = undo, decay_on_commit, not sync_only
        if overlap:
            self._pending = in_flight
        else:
            self._finish(in_flight)
        return ctx.replicate

    def _empty_round(self) -> bool:
        """Commit a round that changes nothing (the node still catches up on steps it missed)."""
        managed = self._managed
        if not managed.commit(trained=False):
            return False
        self._catch_up()
        self._replay.record(LoggedStep(managed.step, None, [], [], [], trained=False))
        return True

    def finish_training(self) -> None:
        """Under torchft with ``join_quorum='when_ready'``: call once after the last step (the Trainer does).

        The node stays while a live node is still on its last step, so that the late one catches up and every
        node ends on the same parameters (:meth:`~hf_flexdemo.fault_tolerance.ManagedReplicas.close`).
        """
        if self._managed is not None and self.config.join_quorum == "when_ready":
            self.flush()
            self._managed.close(self._closing_round)

    def _closing_round(self) -> bool:
        """A round after the job's last step: nothing is sent; late nodes catch up, then every node compares.
        Returns whether it committed (if not, this node has not caught up yet)."""
        committed = self._empty_round()
        self._managed.behind_at_close = not committed
        if not committed:
            return False
        params = [p for group in self.param_groups for p in group["params"]]
        prints = self._managed.fingerprints_of_leaders(parameter_fingerprint(params), closing=True)
        differ = torch.tensor([int(len(set(prints)) > 1)], device=self._managed.device)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every process of the node stops, or none
            dist.all_reduce(differ, op=dist.ReduceOp.MAX)
        if differ.item():
            raise RuntimeError(
                f"FlexDeMo fault tolerance: the nodes end training with different parameters (checksums on this "
                f"process's shard: {prints}) although the late ones caught up: the nodes split (a node trained steps "
                "the others did not see) or a kernel is not deterministic. Each node's last checkpoint is whole; take "
                "the one of the node that trained in the largest quorums."
            )
        return True

    def _finish(self, job: InFlight) -> None:
        received, stats = job.exchange.wait()
        if job.undo is not None and not self._managed.commit():
            restore(job.undo)  # the step did not happen, on this node or any other
            self._book.host_step = None  # the step counts went back: read them again
            return
        parts = split_received(received, job, self.scheme.collective)
        if job.undo is not None:
            self._catch_up()
        if job.decay_on_commit:
            self._decay(job.buckets)
        self._decode_and_apply(job.buckets, parts, job.ctx)
        if job.undo is not None:
            self._replay.record(self._logged(job.buckets, parts, job.ctx, job.training))
        self._count(job, stats)

    def _decay(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            wd = bucket.group["weight_decay"]
            if wd:
                torch._foreach_mul_(bucket.params, 1 - bucket.group["lr"] * wd)

    def _decode_and_apply(self, buckets: list[Bucket], parts: list[Any], ctx: StepContext) -> None:
        """Decode each bucket's exchange and move its parameters by its rule."""
        # Decoded updates are dense: the rules take them a few buckets at a time, so the step holds at most
        # about one bucket's worth beside the state, not the whole model's.
        batch, entries = [], 0
        for bucket, part in zip(buckets, parts):
            decoded = self.scheme.apply(bucket, part, ctx)
            if decoded is None:
                continue
            batch.append(decoded)
            entries += bucket.count * bucket.full_shape.numel()  # whole shapes: every process of a node agrees
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

    def _steps_taken(self) -> int:
        """Optimizer steps taken, kept on the host (read from the state once per build or undo)."""
        if self._book.host_step is None:
            self._book.host_step = int(self._bucketed()[0].scalars("step", torch.int64)[0])
        return self._book.host_step

    def _needs_sync(self) -> bool:
        first = self._bucketed()[0].slots[0]
        return self.scheme.needs_sync(first.state, self._steps_taken())

    def _is_state_creation(self) -> bool:
        """torch's distributed checkpoint creates state with one step of lr 0 and zero gradients: under a
        quorum that step stays local (it moves nothing), so loading a checkpoint does not start a round."""
        params = [p for group in self.param_groups for p in group["params"]]
        return all(float(group["lr"]) == 0.0 for group in self.param_groups) and all(
            p.grad is None or not bool(local_tensor(p.grad).any()) for p in params
        )

    def _bucketed(self) -> list[Bucket]:
        """The buckets of this optimizer's parameters, built when they no longer fit (see :class:`BucketBook`),
        with every state entry created and checked."""
        buckets = self._book.current(self.param_groups)
        if buckets is not None:
            return buckets
        self._flush_counters()  # bytes counted per bucket reach the parameters' counters before rebuilding
        slots_by_group = param_slots(self.param_groups, self.state, self._store)
        all_slots = [slot for slots in slots_by_group for slot in slots]
        if "step" not in all_slots[0].state:
            self._start([slot.state.param for slot in all_slots])
        buckets = build_buckets(slots_by_group, self.bucket_entries)
        for bucket in buckets:  # every state entry exists from the first step on (see ReplicationScheme.init_state)
            bucket.scalars("step", torch.int64)
            self.scheme.init_state(bucket)
            self._rule(bucket.group).init_state(bucket)
            for slot in bucket.slots:
                slot.state.counters(COUNTERS, 2)
                self.scheme.check_state(slot)
                self._rule(bucket.group).check_state(slot)
        if any(bucket.group["update"] == "orthogonal" for bucket in buckets):
            # Under torchft the nodes compare the dtype they took when they meet (no quorum is open here).
            group = self.topology.group if self._managed is None and self.topology.is_replicated else None
            self.rules["orthogonal"].settle_dtype(buckets[0].device, group)
        return self._book.keep(buckets, self.param_groups)

    def _start(self, params: list[torch.Tensor]) -> None:
        """First step: check the layout and that every replica starts from the same parameters."""
        check_layout(params, self._topology or self.topology)
        if self._managed is not None:  # torchft's first quorum copies the first node's state to the others
            return
        prints = replica_fingerprints(params, self.topology)
        if len(set(prints)) > 1:
            logger.warning(
                "FlexDeMo: replicas start from different parameters (fingerprints %s); "
                "copying replica 0's parameters to every replica.",
                prints,
            )
            broadcast_from_first_replica(params, self.topology)

    # -- replicas ----------------------------------------------------------------------

    def replica_fingerprints(self) -> list[int]:
        """Checksums of this process's parameter shards on every replica (a collective).

        Under a quorum: on the live replicas that committed the most steps (one that missed a
        commit heals at its next quorum), or ``[]`` if the comparison itself failed.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        if self._managed is not None:
            return self._managed.fingerprints_of_leaders(parameter_fingerprint(params), len(self._missed or ()))
        return replica_fingerprints(params, self.topology)

    @property
    def replicas_should_match(self) -> bool:
        """Whether, by the scheme's design, replicas hold identical parameters right now."""
        first = next((p for group in self.param_groups for p in group["params"] if p.requires_grad), None)
        if first is None or "step" not in self.state.get(first, {}):
            return True
        slot = self._bucketed()[0].slots[0]
        return self.scheme.replicas_match(slot.state, self._steps_taken())

    # -- state dict --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        self.flush()  # a pending overlap exchange belongs to the state being saved
        self._flush_counters()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_saved_rules(state_dict["param_groups"], self.param_groups)
        check_saved_elementwise_rule(state_dict, self.param_groups, self.rules["orthogonal"].elementwise.name)
        self._pending = None  # an exchange started before loading refers to the replaced state
        self._uncounted.clear()  # so do bytes not yet added to it
        self._book.stale = True
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # torch takes the saved groups' keys; older checkpoints lack this one
            group.setdefault("update", "sign")
        # torch casts floating state to the parameter's dtype; 16-bit parameters keep float32 moments.
        by_id = {}
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            by_id.update(zip(saved["params"], group["params"]))
        for pid, saved_state in state_dict["state"].items():
            p = by_id.get(pid)
            if p is None:
                continue
            for key, value in saved_state.items():
                current = self.state[p].get(key)
                if torch.is_tensor(value) and torch.is_tensor(current) and value.dtype != current.dtype:
                    self.state[p][key] = value.to(device=current.device, copy=True)


def unwrap_flexdemo(optimizer) -> FlexDeMo | None:
    """The FlexDeMo behind ``optimizer`` (Accelerate's wrapper keeps it as ``.optimizer``), or None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, FlexDeMo) else None
