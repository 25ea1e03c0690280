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
from ..optim.apply_rules import weight_decay
from ..schemes.base import ReplicationScheme, StepContext
from ..state_store import StateView
from ..updates.orthogonal import newton_schulz_dtype
from .pipeline import StepPipeline
from .replay import LoggedStep, ReplayLog, map_tensors


class ReplicaState:
    """The optimizer's state as peers exchange it: a healing node's copy or replay, and this node's catch-up.

    ``pipeline`` is the optimizer (read through :class:`~.pipeline.StepPipeline`); ``replay_steps``: how many
    committed steps it keeps for lagging peers (0: none). ``managed`` is the node's
    :class:`~.replicas.ManagedReplicas` once the optimizer is attached to a quorum.
    """

    def __init__(self, pipeline: StepPipeline, replay_steps: int):
        self.pipeline: StepPipeline = pipeline
        self.managed = None
        self.replay = ReplayLog(replay_steps)
        """The last committed steps, which a lagging peer may replay."""
        self.missed: list[LoggedStep] | None = None
        """Steps this node missed, replayed at its next commit."""

    def _ordered_params(self) -> list[torch.Tensor]:
        return [p for group in self.pipeline.param_groups for p in group["params"] if p.requires_grad]

    def shared_keys(self) -> tuple[str, ...]:
        """The state entries every replica holds alike: what a healing node copies."""
        rules = self.pipeline.rules.values()
        return ("step", *self.pipeline.scheme.shared_keys, *(key for rule in rules for key in rule.state_keys))

    def serve(self) -> dict[str, Any]:
        """What a peer that is behind needs, as copies: the groups' hyperparameters (the lr a scheduler has set),
        and either the steps it missed, to replay (see :mod:`.replay`), or the parameters, step counts and the
        scheme's and rules' shared state."""
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self.pipeline.param_groups]
        missed = self._steps_missed_by_healing_peers()
        if missed is not None:
            return {"groups": groups, "replay": missed}
        keep, state = self.shared_keys(), self.pipeline.state
        return {
            "groups": groups,
            "params": [local_tensor(p).detach().clone() for p in self._ordered_params()],
            "state": [
                {k: local_tensor(v).clone() for k, v in state.get(p, {}).items() if k in keep}
                for p in self._ordered_params()
            ],
        }

    def _steps_missed_by_healing_peers(self) -> list[LoggedStep] | None:
        """The logged steps that bring every node healing from this one up to date, if this node holds them all.

        A node with no committed step (new, or relaunched without a checkpoint) holds none of the job's state:
        it copies the whole state.
        """
        if not len(self.replay):
            return None
        behind = self.managed.healing.healing_steps()
        if not behind or min(behind) == 0:
            return None
        # Decided from what every process of this node sees alike (the Lighthouse's page, the steps held), so
        # all of a healing node's processes replay, or none.
        missed = self.replay.since(min(behind), self.managed.step)
        if missed is None:
            return None
        # Received payloads are typed views of one byte buffer, which torch.save refuses: each travels as its own.
        return [
            dataclasses.replace(
                step, parts=map_tensors(step.parts, torch.clone), carried=map_tensors(step.carried, torch.clone)
            )
            for step in missed
        ]

    def log(self, buckets: list[Bucket], parts: list[Any], ctx: StepContext, *, trained: bool) -> None:
        """Keep this committed step, as a lagging peer would replay it."""
        self.replay.record(
            LoggedStep(
                committed=self.managed.step,
                ctx=dataclasses.replace(ctx, noise=None),
                groups=[{k: v for k, v in bucket.group.items() if k != "params"} for bucket in buckets],
                carried=[bucket.carried for bucket in buckets],
                parts=parts,
                trained=trained,
            )
        )

    def log_empty_round(self) -> None:
        """Keep a committed round that exchanged nothing (the parameters did not move)."""
        self.replay.record(LoggedStep(self.managed.step, None, [], [], [], trained=False))

    def nbytes(self) -> int:
        """What copying the whole state moves to this process: its parameter shards and their shared state."""
        keep, state = self.shared_keys(), self.pipeline.state
        tensors = [local_tensor(p) for p in self._ordered_params()] + [
            local_tensor(v) for p in self._ordered_params() for k, v in state.get(p, {}).items() if k in keep
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def take(self, peer: dict[str, Any]) -> None:
        """Take a peer's parameters and shared state, or the steps to replay; this replica's own momentum stays
        (see fault_tolerance)."""
        pipeline = self.pipeline
        assert not pipeline.config.overlap, "a peer's state would meet a pending exchange (refused by the config)"
        if pipeline.store is None:  # a node not attached yet keeps its own layout (decided on first use)
            pipeline.topology  # noqa: B018
        if "replay" in peer:
            self._take_missed_steps(peer)
            return
        self.missed = None  # the whole state supersedes any steps still to replay
        if self.managed is not None:
            self.managed.healing.note_copy(self.nbytes())
        for group, saved in zip(pipeline.param_groups, peer["groups"]):
            group.update(saved)
        for p, value, state in zip(self._ordered_params(), peer["params"], peer["state"]):
            local_tensor(p).data.copy_(value)
            mine = StateView(pipeline.store, p, local_tensor(p), pipeline.state[p])
            for key, peer_value in state.items():
                if key in mine:
                    local_tensor(mine.raw[key]).copy_(peer_value)
                elif peer_value.shape == local_tensor(p).shape:  # laid out like the parameter
                    mine.shared(key, lambda v=peer_value: v.clone())
                else:  # a count
                    mine.raw[key] = peer_value.clone()
            pipeline.scheme.healed(local_tensor(p), mine)
        pipeline.book.forget()  # the state was replaced: the buckets are built again at the next step

    def _take_missed_steps(self, peer: dict[str, Any]) -> None:
        """Keep a peer's logged steps for the next commit, when every process of the node replays them together
        (the orthogonal rule's in-node exchange needs all of them; a process whose recovery failed fails the
        commit, so nothing is replayed by half a node)."""
        missed: list[LoggedStep] = peer["replay"]
        pending = self.missed or []
        held = pending[-1].committed if pending else self.managed.steps_before_quorum
        if missed[0].committed != held + 1:
            raise RuntimeError(
                f"FlexDeMo: a peer sent steps {missed[0].committed}-{missed[-1].committed} to replay, but this node "
                f"holds the state after step {held}; it cannot catch up by replay. Relaunch this node: it then copies "
                "the whole state."
            )
        for group, saved in zip(self.pipeline.param_groups, peer["groups"]):
            group.update(saved)
        self.missed = pending + missed
        self.managed.healing.note_catch_up(len(missed), sum(step.nbytes for step in missed), self.nbytes())

    def steps_to_replay(self) -> int:
        """Training steps this node missed and has not replayed yet."""
        return sum(step.trained for step in self.missed or ())

    def catch_up(self) -> None:
        """At a commit: replay the steps this node missed, once every process of the node agrees on them."""
        pending = self.missed or []
        if self.replay.capacity and dist.is_initialized() and dist.get_world_size() > 1:
            counts = torch.tensor([len(pending), -len(pending)], device=self.managed.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            if int(counts[0]) != -int(counts[1]):
                raise RuntimeError(
                    f"FlexDeMo: the processes of this node hold between {-int(counts[1])} and {int(counts[0])} missed "
                    "steps to replay (a recovery failed on some of them), so they cannot catch up together. Relaunch "
                    "this node: it then copies the whole state."
                )
        if not pending:
            return
        self.missed = None
        buckets = self.pipeline.buckets()
        for step in pending:
            if step.groups:  # a round that changed nothing has no buckets
                self._replay_step(buckets, step)
            self.replay.record(step)
        self.pipeline.book.forget_step_count()  # the step counts moved on: read them again

    def _replay_step(self, buckets: list[Bucket], step: LoggedStep) -> None:
        """One missed step, as the peers applied it: weight decay, then each bucket's decoded update."""
        if len(step.groups) != len(buckets):
            raise RuntimeError(
                f"FlexDeMo: a replayed step has {len(step.groups)} buckets, this node {len(buckets)}: the nodes do "
                "not hold the same parameters. Launch every node with the same model and settings."
            )
        device = buckets[0].device
        stepping = []
        for bucket, group, carried in zip(buckets, step.groups, step.carried):
            if step.trained:
                bucket.scalars("step", torch.int64).add_(1)
            moved = bucket.for_step()
            moved.group.update(group)
            moved.carried = map_tensors(carried, lambda t: t.to(device))
            stepping.append(moved)
        if step.ctx is not None:  # weight decay in the rules' pass, as the peers applied it
            parts = map_tensors(step.parts, lambda t: t.to(device))
            self.pipeline.applier.decode_and_apply(stepping, parts, step.ctx, decay=step.trained)
        elif step.trained:
            weight_decay(stepping)

    def describe_layout(self) -> dict[str, Any]:
        """Settings and shapes every node must share, compared when a node first meets the others. Group
        hyperparameters are left out: a node that joins has its scheduler's first ``lr`` until it heals."""
        # join_quorum is compared: nodes that join when ready skip the rounds of synchronize(), which the others
        # would wait in.
        described = self.pipeline.describe_replica()
        settings = described["settings"]
        if settings.get("update") == "orthogonal" and settings["ns_dtype"] == "auto":  # by device: may differ
            dtype = newton_schulz_dtype("auto", local_tensor(self._ordered_params()[0]).device)
            taken = "bf16" if dtype == torch.bfloat16 else "float32"
            settings["ns_dtype"] = f"auto, {taken} on this node's devices (set ns_dtype='{taken}' on every node)"
        return described


def snapshot(buckets: list[Bucket], scheme: ReplicationScheme, *, undo_step: bool, with_params: bool) -> list:
    """Copies of what a step changes before its exchange, to undo it: the step counts, the state the scheme's
    local maths changes, and (``with_params``) the parameters where weight decay or local steps move them."""
    saved = []
    for bucket in buckets:
        tensors = {k: bucket.buffers[k].clone() for k in scheme.local_keys if k in bucket.buffers}
        tensors["step"] = bucket.buffers["step"] - (1 if undo_step else 0)  # the counts already moved on
        moved = with_params and (scheme.moves_parameters_locally or bucket.group["weight_decay"] != 0)
        saved.append((bucket, bucket.stacked_params() if moved else None, tensors))
    return saved


def restore(saved: list) -> None:
    for bucket, params, tensors in saved:
        if params is not None:
            bucket.copy_to_params(params)
        for key, value in tensors.items():
            bucket.buffers[key].copy_(value)
        bucket.carried = None


def undo_local_step(saved: list) -> None:
    """Undo a training step's local maths after a heal that replayed steps (they moved the step counts on:
    one step is taken back from them, and the scheme's local state is restored)."""
    for bucket, _, tensors in saved:
        for key, value in tensors.items():
            if key == "step":
                bucket.buffers["step"].sub_(1)
            else:
                bucket.buffers[key].copy_(value)
        bucket.carried = None
