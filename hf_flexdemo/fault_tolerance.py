"""Live fault tolerance across nodes on torchft: a lost node never stops the others.

With ``fault_tolerance="torchft"`` each node (one replica: FSDP2 inside it) is its own job.
Every step, each process's torchft ``Manager`` joins a quorum of the live nodes through the
Lighthouse, and the replicate exchange runs on a torchft process group rebuilt for that
quorum. One step, as seen from one process::

    begin()    quorum of live nodes; a node that is behind (new, relaunched, or one that
               missed a commit) first copies the state a healthy peer serves
    exchange   FlexDeMo's one packed collective, over the live replicas only
    commit()   every process of the node votes; a step whose exchange failed anywhere in
               the node is not applied (the optimizer restores what it had changed)

Replicas never diverge: torchft counts committed steps, and a node with fewer commits than
the most advanced one heals from it at its next quorum.

What a healing node copies (:meth:`ManagedReplicas.register`): the parameters and the
state that must match across replicas (the optimizer's step count, DiLoCo's anchor and
outer momentum, and with the Trainer the global step and scheduler position). Its own
momentum is kept (zeros for a new node): DeMo momentum is per replica by design, and a
peer's holds the peer's unsent residual, which would be sent twice.

torchft is imported only when a :class:`ManagedReplicas` is built, never on the default path.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceOp

from .config import FlexDeMoConfig
from .lighthouse import (
    LIGHTHOUSE_ENV,
    FaultToleranceError,
    LighthouseView,
    NodeIdentity,
    QuorumWatch,
    import_torchft,
    job_state_verdict,
    lighthouse_status,
    node_of,
    read_lighthouse,
)
from .topology import ReplicaTopology

__all__ = [
    "FaultToleranceError",
    "ManagedReplicas",
    "NodeIdentity",
    "import_torchft",
    "lighthouse_status",
    "node_replicas",
]

logger = logging.getLogger(__name__)

WAIT_NOTICE_S = 5.0
"""How often a node waiting for its quorum says so, and who is missing."""
MAX_UNCOMMITTED = 10
"""Steps in a row a node may fail to commit before it stops (a streak means the quorum cannot work)."""
MAX_FAILED_JOINS = 3
"""Quorums in a row this node may fail to join (its recovery or process group failed) before it stops.

While it fails, the other nodes wait up to ``ft_timeout`` in each step's collective for it, so
it gives up well before they would (``MAX_UNCOMMITTED``): relaunched, it tries afresh."""
MAX_STORY_CHANGES = 6
"""Quorum changes the run summary spells out; the rest are counted, and the last is said."""
NODE_STATE_KEY = "flexdemo_node"
"""The first entry of the state a healing node receives: the peer's settings, checked before anything loads."""
ROUND_STATE_KEY = "flexdemo_round"
"""The second entry: whether the peer has finished training (the round is then a closing round), and which
nodes it knows to have finished."""
CLOSING_POLL_S = 0.2
"""How often a node that finished training looks for a late node waiting to catch up."""


@dataclass(frozen=True)
class ManagedTopology(ReplicaTopology):
    """The replicas of one step's quorum: collectives run on torchft's process group, errors are reported."""

    replicas: ManagedReplicas | None = None

    @property
    def is_managed(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self.replicas.device

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        return self.replicas.all_gather_into(output, tensor)

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        return self.replicas.all_reduce_sum(tensor)


class _ReportedWork:
    """A collective whose failure is reported to the manager (the step will not commit) instead of raised."""

    def __init__(self, work, replicas: ManagedReplicas):
        self._work, self._replicas = work, replicas

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait()
        except Exception as e:  # a peer died or timed out mid-exchange
            self._replicas.report(e)


class ManagedReplicas:
    """This process's membership in the quorum of nodes (one torchft ``Manager``).

    Build one per process, after ``torch.distributed`` is initialised for the node's own
    processes (FSDP2 inside the node); the node's rank 0 talks to the Lighthouse.

    Args:
        config: the optimizer's settings (``min_replicas``, ``ft_timeout``, ``quorum_timeout``).
        identity: the Lighthouse address and this node's index (default: from the environment).
        device: where exchanges run (``cuda`` uses torchft's NCCL group, otherwise gloo).
    """

    def __init__(self, config: FlexDeMoConfig, identity: NodeIdentity | None = None, device=None):
        torchft = import_torchft()
        self.config = config
        self.identity = identity or NodeIdentity.from_env(config.min_replicas)
        self.device = torch.device(device or "cpu")
        self._round_open = False
        self._met = False  # whether a quorum has formed yet
        self._uncommitted = 0  # steps in a row not committed
        self._why_uncommitted = ""  # why the last step did not commit
        self._failed_joins = 0  # quorums in a row this node failed to join
        self._state_fns: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._healed = False
        self._describers: dict[str, Callable[[], Any]] = {}
        timeout = timedelta(seconds=config.ft_timeout)
        group_class = (
            torchft.process_group.ProcessGroupNCCL
            if self.device.type == "cuda"
            else torchft.process_group.ProcessGroupGloo
        )
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        store_addr = store_port = None
        if "MASTER_ADDR" not in os.environ:  # one process, not launched by torchrun: the manager needs a store
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self._store.port
        if self.device.type == "cuda":
            nccl_nonblocking_timeout(config.ft_timeout)
        self._group = group_class(timeout=timeout)
        try:
            self.manager = torchft.manager.Manager(
                pg=self._group,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=config.min_replicas,
                use_async_quorum=False,  # heal before the forward pass: the step's gradient is the healed model's
                timeout=timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout),
                connect_timeout=timeout,
                rank=rank,
                world_size=world,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=self.identity.lighthouse,
                replica_id=self.identity.name,
                init_sync=True,  # step 0: every node starts from the first node's parameters
            )
        except Exception as e:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self.identity.name} could not join the Lighthouse at "
                f"{LIGHTHOUSE_ENV}={self.identity.lighthouse} within ft_timeout={config.ft_timeout:g} s: {e}. Check "
                "that torchft_lighthouse runs there and that this node can reach it."
            ) from e
        self._shut_down = False
        atexit.register(_shut_down_at_exit, weakref.ref(self))
        # Registered first, so a healing node checks the peer's settings before loading anything.
        self.manager.register_state_dict_fn(NODE_STATE_KEY, self._check_peer, self._describe)
        self.manager.register_state_dict_fn(ROUND_STATE_KEY, self._take_round, self._serve_round)
        self.finished = False
        """Whether this node has finished training: every round it joins from then on is a closing round."""
        self._final_step = 0  # torchft's committed steps when the job's last training step had committed
        self._finished_nodes: set[str] = set()  # nodes known to have finished training
        self.behind_at_close = False
        """Whether this node's last closing round failed to commit: it has not caught up yet."""
        self._rank = rank
        self._quorum = QuorumWatch(self.manager)
        self._undone = 0  # steps undone on this node since the quorum last changed
        self._resumed = False  # whether this node continues from a checkpoint
        self._job: LighthouseView | None = None  # the job as the Lighthouse saw it before this node joined
        self._settled = False  # whether this node has committed a step (then it holds the job's state)
        self.membership: list[tuple[int, tuple[str, ...]]] = []
        """``(committed steps, nodes)`` at each change of the quorum's nodes this node saw, oldest first."""
        self.committed_node_steps = 0
        """Sum of the quorum's size over the steps this node committed since this process started."""
        self.steps_before_quorum = 0
        """The committed steps this node held when it asked for the current quorum (before any heal)."""
        self._catch_up: tuple[int, int, int] | None = None  # this round: (steps, bytes) replayed, bytes of a copy
        self._copied = 0  # this round: bytes of the whole state copied to this process
        self.catch_ups: list[tuple[int, int, int]] = []
        """Every catch-up by replay since this process started: (steps, bytes moved, bytes a full copy moves)."""
        logger.info(
            "FlexDeMo fault tolerance: %s (rank %d of %d) joined the Lighthouse at %s; min_replicas=%d.",
            self.identity.name,
            rank,
            world,
            self.identity.lighthouse,
            config.min_replicas,
        )

    # -- what a healing node receives ---------------------------------------------------

    def register(self, key: str, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Serve ``state()`` to nodes that heal from this one; ``load`` applies a peer's on this node.

        ``state()`` must return copies: torchft serves it while this node trains on. Registering
        a key again (a second Trainer in the process) replaces its functions.
        """
        if key not in self._state_fns:
            self.manager.register_state_dict_fn(key, lambda value: self._load(key, value), lambda: self._serve(key))
        self._state_fns[key] = (state, load)

    def _serve(self, key: str) -> Any:
        return self._state_fns[key][0]()

    def _load(self, key: str, value: Any) -> None:
        try:
            self._state_fns[key][1](value)
        except FaultToleranceError:
            raise
        except Exception as e:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self.identity.name} could not take the live state ({key!r}) of a "
                f"peer: {type(e).__name__}: {e}"
            ) from e
        self._healed = True

    def _serve_round(self) -> dict[str, Any]:
        return {"finished": self.finished, "nodes": sorted(self._finished_nodes)}

    def _take_round(self, peer: dict[str, Any]) -> None:
        if peer["finished"]:
            self.finished = True
            self._finished_nodes.update(peer["nodes"])

    def start_training(self) -> None:
        """A new training run in this process (a second ``train()``): its rounds train again."""
        self.finished, self._final_step, self.behind_at_close = False, 0, False
        self._finished_nodes.clear()

    def agree_on_finished(self) -> bool:
        """Whether any process of this node healed from a node that finished (then all of them close).

        Each process takes the peer's state on its own; one whose recovery failed would otherwise train while
        the others close, and the node's collectives would no longer match."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(self.finished)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.finished = bool(flag.item())
        return self.finished

    def describe(self, part: str, describe: Callable[[], Any]) -> None:
        """What must be equal on every node (settings, shapes): compared when a node first takes a peer's state."""
        self._describers[part] = describe

    def _describe(self) -> dict[str, Any]:
        return {part: fn() for part, fn in self._describers.items()} | {"node": self.identity.name}

    def _check_peer(self, peer: dict[str, Any]) -> None:
        ours, theirs = _flatten(self._describe()), _flatten(peer)
        differ = [
            f"{key}: {peer.get('node')} has {theirs.get(key)!r}, this node {ours.get(key)!r}"
            for key in sorted(set(ours) | set(theirs))
            if key != "node" and ours.get(key) != theirs.get(key)
        ]
        if differ:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self.identity.name} does not fit the running job and stops before "
                f"loading anything; launch it with the same settings and model as the others. Differences: "
                + "; ".join(differ)
            )

    # -- one step --------------------------------------------------------------------------

    def begin(self) -> bool:
        """Join this step's quorum (no-op if open); returns True if this call copied a peer's state."""
        if self._round_open:
            return False
        self._healed = False
        self._catch_up, self._copied = None, 0
        self.steps_before_quorum = self.manager.current_step()
        if not self._met and self._rank == 0:
            self._job = read_lighthouse(self.identity.lighthouse)
        previous = self._quorum.members
        done = threading.Event()
        watcher = threading.Thread(target=self._say_while_waiting, args=(done,), daemon=True)
        watcher.start()
        try:
            self.manager.start_quorum()
        except FaultToleranceError:
            raise
        except Exception as e:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self.identity.name} could not join a quorum of min_replicas="
                f"{self.config.min_replicas} live nodes (quorum_timeout={self.config.quorum_timeout:g} s): "
                f"{type(e).__name__}: {e}. {lighthouse_status(self.identity.lighthouse)}. Stopping; every "
                "completed checkpoint is whole."
            ) from e
        finally:
            done.set()
        self._round_open = self._met = True
        error = self.manager.errored()
        if error is None:
            self._failed_joins = 0
        else:  # the quorum formed, but this node's recovery or process group set-up failed
            self._failed_joins += 1
            if self._failed_joins >= MAX_FAILED_JOINS:
                raise FaultToleranceError(
                    f"FlexDeMo fault tolerance: {self.identity.name} failed to join {self._failed_joins} quorums in a "
                    f"row ({error.original_exception}); it stops so that the other nodes are not held up. Relaunch "
                    "it once the cause is fixed (a peer's host name must resolve from here, and one shard must "
                    "transfer within ft_timeout)."
                )
            logger.warning(
                "FlexDeMo fault tolerance: %s could not join this step's quorum (%s); the step will be undone and "
                "it tries again at the next one.",
                self.identity.name,
                error.original_exception,
            )
        self._say_quorum_change(previous)
        if self.finished and not self._final_step:  # a late node healed from one that finished: so does it
            self._final_step = self.manager.current_step()
        if not self._settled:  # also after a failed first heal: the nodes it was to heal from may leave
            self._check_job_state(self._job)
        if self._healed and self._catch_up is not None:
            steps, moved, copy = self._catch_up
            self.catch_ups.append(self._catch_up)
            if self._rank == 0:  # said once: a node that is always late would say it every few steps
                say = logger.warning if len(self.catch_ups) == 1 else logger.debug
                say(
                    "FlexDeMo fault tolerance: %s missed %d committed step(s) and catches up by replaying their "
                    "exchanged payloads (%s on this process; copying the whole state would move %s). Later "
                    "catch-ups are counted in the run summary.",
                    self.identity.name,
                    steps,
                    _megabytes(moved),
                    _megabytes(copy),
                )
        elif self._healed:
            # At step 0 every node takes the first node's initial parameters: nothing was lost.
            say = logger.warning if self.manager.current_step() > 0 and self._rank == 0 else logger.info
            say(
                "FlexDeMo fault tolerance: %s took the parameters and training position from a live peer "
                "(%d steps committed by the quorum; %s to this process) and trains on from there.",
                self.identity.name,
                self.manager.current_step(),
                _megabytes(self._copied),
            )
        return self._healed

    def _say_quorum_change(self, previous: tuple[str, ...]) -> None:
        """One line when the quorum's nodes change: who left or joined, and the steps undone meanwhile."""
        members = self._quorum.members
        if members == previous:
            return
        self.membership.append((self.manager.current_step(), members))  # also on the ranks that do not say it
        undone, self._undone = self._undone, 0
        if not previous or self._rank != 0:
            return
        size = "shrinks" if len(members) < len(previous) else "grows" if len(members) > len(previous) else "changes"
        logger.warning(
            "FlexDeMo fault tolerance: %s: the quorum %s from %d to %d live nodes (%s; now %s) at %d committed "
            "steps; %d step(s) undone on this node since the last change.",
            self.identity.name,
            size,
            len(previous),
            len(members),
            quorum_moves(previous, members),
            ", ".join(members),
            self.manager.current_step(),
            undone,
        )

    def _check_job_state(self, before: LighthouseView | None) -> None:
        """Until its first commit, a node must not quietly start over a job whose state left with its nodes.

        ``before`` is the Lighthouse's view before this node joined (read on rank 0, which decides
        for the node). The quorum's committed steps (this node's after healing) below the last
        quorum's, with none of that quorum's other nodes still heartbeating, mean the state is gone.
        """
        verdict: list = [None]
        if self._rank == 0 and before is not None and before.job_step > self.manager.current_step():
            now = read_lighthouse(self.identity.lighthouse)
            verdict[0] = job_state_verdict(before, now, self.identity.name, self.manager.current_step(), self._resumed)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is None:
            return
        kind, message = verdict[0]
        if kind == "refuse":
            raise FaultToleranceError(message)
        if self._rank == 0:
            logger.warning(message)

    def resume(self, state: dict[str, int] | None) -> None:
        """Continue from a checkpoint: ``state`` is :meth:`state_dict` as it was saved (``None``: not saved)."""
        if state:
            self.manager.load_state_dict(state)
        self._resumed = True

    def state_dict(self) -> dict[str, int]:
        """torchft's committed-step count, for a checkpoint: a node resumed from it heals only if behind."""
        return self.manager.state_dict()

    def _say_while_waiting(self, done: threading.Event) -> None:
        started = time.monotonic()
        while not done.wait(WAIT_NOTICE_S):
            logger.warning(
                "FlexDeMo fault tolerance: %s has waited %.0f s for a quorum of min_replicas=%d live nodes "
                "(stops after quorum_timeout=%g s). %s.",
                self.identity.name,
                time.monotonic() - started,
                self.config.min_replicas,
                self.config.quorum_timeout,
                lighthouse_status(self.identity.lighthouse),
            )

    @property
    def round_open(self) -> bool:
        """Whether this step's quorum is joined and not yet committed."""
        return self._round_open

    def commit(self, trained: bool = True) -> bool:
        """Every process of the node agrees whether the step stands; False: undo it.

        ``trained``: whether the round trained a step (not a round of ``synchronize()`` or a closing one), for the
        samples it counts."""
        self._round_open = False
        error = self.manager.errored()
        live = self.manager.num_participants()
        committed = self.manager.should_commit()
        if committed:
            self._uncommitted = 0
            self._settled = True
            self.committed_node_steps += live if trained else 0
            return True
        self._uncommitted += 1
        self._undone += 1
        if error:
            why = "its exchange with the quorum failed: a node left or timed out"
            logger.info("FlexDeMo fault tolerance: %s: %s", self.identity.name, error.original_exception)
        elif live < self.config.min_replicas:
            why = f"{live} live node(s), fewer than min_replicas={self.config.min_replicas}"
        else:
            why = "another process of this node failed the step"
        self._why_uncommitted = why
        if self._uncommitted > MAX_UNCOMMITTED:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self.identity.name} could not commit {self._uncommitted} steps in a row "
                f"(last: {why}). If too few nodes are live, start the Lighthouse with --min_replicas "
                f"{self.config.min_replicas} (the job's min_replicas) so that nodes wait for a quorum instead. "
                f"{lighthouse_status(self.identity.lighthouse)}."
            )
        if self._rank == 0:
            logger.warning(
                "FlexDeMo fault tolerance: %s did not commit this step (%s); the step is undone on this node (its "
                "batch is skipped) and training goes on.",
                self.identity.name,
                why,
            )
        return False

    def check_trained(self) -> None:
        """At the end of training: a node that failed every step it ran trained nothing, an error, not a quiet exit.

        A run shorter than the streak :meth:`commit` stops at would otherwise end as if it had trained.
        """
        if self._settled or not self._uncommitted:
            return
        raise FaultToleranceError(
            f"FlexDeMo fault tolerance: {self.identity.name} finished training without committing a step "
            f"(last: {self._why_uncommitted}); its parameters are where they started. If too few nodes were live, "
            f"start the Lighthouse with --min_replicas {self.config.min_replicas} (the job's min_replicas) so that "
            f"nodes wait for each other. {lighthouse_status(self.identity.lighthouse)}."
        )

    def close(self, closing_round: Callable[[], bool]) -> None:
        """At the end of training: stay while a live node is still on its last step, so that it ends on the same model.

        With ``join_quorum='when_ready'`` the job's last step can commit without a late node; were the others to
        leave, it would commit a last step of its own. So a node that finished joins a closing round whenever one
        waits at the Lighthouse: nothing is exchanged, the late node catches up (by replay, or a copy) and finishes
        too, and ``closing_round()`` commits the round. It leaves once every heartbeating node has finished (it was
        in this node's last round, or in a round after the job's last step), or after ``quorum_timeout``.
        """
        if not self._met:
            return
        self.finished = True
        self._final_step = self._final_step or self.manager.current_step()
        # A last training step that did not commit here leaves this node behind the others: it catches up too.
        self.behind_at_close = self.behind_at_close or self._uncommitted > 0
        self._finished_nodes.update(self._quorum.members)
        deadline = time.monotonic() + self.config.quorum_timeout
        said = False
        while True:
            action, training = self._closing_action(self._finished_nodes, deadline)
            if action == "round":
                try:
                    self.begin()
                except FaultToleranceError as e:  # the others left meanwhile: nothing to catch up from
                    logger.warning(
                        "FlexDeMo fault tolerance: %s: no closing round after training: %s", self.identity.name, e
                    )
                    return
                self.behind_at_close = not closing_round()
            elif action == "wait":
                if not said and self._rank == 0:
                    logger.warning(
                        "FlexDeMo fault tolerance: %s finished training and stays for %s, still on its last step "
                        "(at most quorum_timeout=%g s), so that it ends on the same model.",
                        self.identity.name,
                        ", ".join(training),
                        self.config.quorum_timeout,
                    )
                said = True
                time.sleep(CLOSING_POLL_S)
            else:
                if action == "give up" and self._rank == 0:
                    logger.warning(
                        "FlexDeMo fault tolerance: %s stops waiting for %s after quorum_timeout=%g s; a node that "
                        "finishes its last step after this one left commits it without it and may end on another "
                        "model (its summary says so).",
                        self.identity.name,
                        ", ".join(training),
                        self.config.quorum_timeout,
                    )
                return

    def _closing_action(self, finished: set[str], deadline: float) -> tuple[str, list[str]]:
        """What a node that finished does next: ``round``, ``wait``, ``done`` or ``give up``; decided on rank 0."""
        decision: list = [("done", [])]
        if self._rank == 0:
            view = read_lighthouse(self.identity.lighthouse)
            if view.job_step >= self._final_step:  # a round after the job's last step: its nodes have finished
                finished.update(node_of(replica) for replica in view.last_quorum)
            training = sorted({node_of(replica) for replica in view.heartbeating} - finished - {self.identity.name})
            if view.error:
                decision[0] = ("done", [])
            elif view.waiting or (self.behind_at_close and training and time.monotonic() < deadline):
                decision[0] = ("round", training)
            elif not training:
                decision[0] = ("done", [])
            else:
                decision[0] = ("give up" if time.monotonic() > deadline else "wait", training)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        return decision[0]

    def ending_note(self) -> str:
        """A warning when this node's last quorum held fewer nodes than it trained with ("" otherwise).

        Nodes that finished (or left) while this one was late committed steps it never saw: its final
        parameters may then differ from theirs. Said at the end of training, in one line.
        """
        if self.behind_at_close:
            return (
                f"FlexDeMo fault tolerance: {self.identity.name} ended training behind the others: its last round did "
                "not commit and no node that finished was left to catch up from. Take the job's final model from "
                "another node."
            )
        if not self.membership:
            return ""
        largest = max(self.membership, key=lambda seen: len(seen[1]))[1]
        step, last = self.membership[-1]
        if len(last) >= len(largest):
            return ""
        gone = ", ".join(node for node in largest if node not in last)
        return (
            f"FlexDeMo fault tolerance: {self.identity.name} ended in a quorum of {len(last)} node(s) "
            f"({', '.join(last)}) from {step} committed steps on, without {gone}, who trained with it before. If they "
            f"finished while it was late, the nodes' last steps differ: take the job's final model from a node of the "
            f"largest last quorum (each node's summary line 'quorum of live nodes' says its own; {self.step} committed "
            "steps here)."
        )

    def membership_story(self) -> str:
        """How the quorum grew and shrank while this node was in it, in one line."""
        if not self.membership:
            return "no quorum met"
        step, nodes = self.membership[0]
        parts = [f"{len(nodes)} node(s) ({', '.join(nodes)}) after {step} committed steps"]
        for (_, before), (step, nodes) in itertools.pairwise(self.membership):
            size = "grew" if len(nodes) > len(before) else "shrank" if len(nodes) < len(before) else "changed"
            parts.append(f"{size} to {len(nodes)} after {step} ({quorum_moves(before, nodes)})")
        if len(parts) > MAX_STORY_CHANGES + 1:  # a node that is always late comes and goes every few steps
            hidden = len(parts) - MAX_STORY_CHANGES - 1
            parts = [*parts[:MAX_STORY_CHANGES], f"{hidden} more change(s)", parts[-1]]
        return "; ".join(parts) + f"; {self.step} committed steps in all"

    def note_catch_up(self, steps: int, moved: int, copy: int) -> None:
        """This round's heal is a replay of ``steps`` missed steps (``moved`` bytes; a full copy: ``copy``)."""
        self._catch_up = (steps, moved, copy)

    def note_copy(self, copied: int) -> None:
        """This round's heal copied the whole state (``copied`` bytes to this process)."""
        self._copied = copied

    def healing_steps(self) -> list[int] | None:
        """Committed steps of the current quorum's nodes that are behind (None: the Lighthouse did not answer)."""
        view = read_lighthouse(self.identity.lighthouse)
        if view.error or not view.last_quorum:
            return None
        ahead = max(view.last_quorum.values())
        return [steps for steps in view.last_quorum.values() if steps < ahead]

    def catch_up_story(self) -> str:
        """The catch-ups by replay of this process, in one line ("" if none)."""
        if not self.catch_ups:
            return ""
        steps = sum(steps for steps, _, _ in self.catch_ups)
        moved = sum(moved for _, moved, _ in self.catch_ups)
        copies = sum(copy for _, _, copy in self.catch_ups)
        return (
            f"{len(self.catch_ups)} catch-up(s) by replay, {steps} missed step(s), {_megabytes(moved)} to one "
            f"process (copies of the state would have moved {_megabytes(copies)})"
        )

    def report(self, error: Exception) -> None:
        self.manager.report_error(error)

    @property
    def step(self) -> int:
        """Steps committed by the quorum so far."""
        return self.manager.current_step()

    def topology(self) -> ManagedTopology:
        """The replicas of the current (or, between steps, the last) quorum."""
        if not self._met:
            return ManagedTopology(group=None, size=1, rank=0, replicas=self)
        rank = self.manager.participating_rank()
        return ManagedTopology(group=None, size=self.manager.num_participants(), rank=rank or 0, replicas=self)

    def fingerprints_of_leaders(
        self, fingerprint: torch.Tensor, unapplied: int = 0, closing: bool = False
    ) -> list[int]:
        """Parameter checksums of the last quorum's nodes that committed the most steps ([] if it failed).

        A node that missed a commit differs on purpose until its next quorum heals it, and one whose
        parameters still lack ``unapplied`` steps it will replay counts as that far behind. After training
        (:meth:`close`) only a closing round compares: the others no longer join this node's collectives.
        """
        topology = self.topology()
        if topology.size == 1 or (self.finished and not closing):
            return [int(fingerprint)]
        mine = torch.tensor([self.step - unapplied, int(fingerprint)], dtype=torch.int64, device=self.device)
        gathered = torch.zeros(2 * topology.size, dtype=torch.int64, device=self.device)
        self.all_gather_into(gathered, mine).wait()
        if self.manager.errored():
            return []
        pairs = gathered.view(-1, 2).tolist()
        lead = max(step for step, _ in pairs)
        return [value for step, value in pairs if step == lead]

    # -- collectives on the quorum's process group ---------------------------------------

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor) -> _ReportedWork:
        if self.manager.errored():
            return _ReportedWork(None, self)
        size = output.numel() // max(tensor.numel(), 1)
        parts = list(output.view(size, -1).unbind(0)) if tensor.numel() else [output] * size
        try:
            work = self._group.allgather([parts], [tensor.view(-1)], AllgatherOptions())
        except Exception as e:
            self.report(e)
            return _ReportedWork(None, self)
        return _ReportedWork(work, self)

    def all_reduce_sum(self, tensor: torch.Tensor) -> _ReportedWork:
        if self.manager.errored():
            return _ReportedWork(None, self)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        try:
            work = self._group.allreduce([tensor], options)
        except Exception as e:
            self.report(e)
            return _ReportedWork(None, self)
        return _ReportedWork(work, self)

    def shutdown(self) -> None:
        """Stop this node's torchft manager and free its process group; runs at exit, while Python is whole.

        Left to the interpreter's teardown, a gloo collective still pending at exit completes on a
        gloo thread that can no longer take the GIL, and a run that went well ends in SIGABRT
        ("terminate called without an active exception"). Freed here, the group waits for such a
        collective instead, ``ft_timeout`` at most; the manager stops after it, so that a peer
        still taking this node's state meanwhile can finish.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self._group.shutdown()
        self.manager.shutdown(wait=False)
        self._store = None


NCCL_NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


def nccl_nonblocking_timeout(ft_timeout: float) -> None:
    """Bound NCCL's non-blocking operations by ``ft_timeout``, unless the user set the variable.

    torchft's NCCL group sets this variable to its own timeout when it is unset, with a warning at
    every node start; set first, it holds the same value and the start says nothing.
    """
    os.environ.setdefault(NCCL_NONBLOCKING_TIMEOUT_ENV, str(float(ft_timeout)))


def _shut_down_at_exit(replicas: weakref.ref[ManagedReplicas]) -> None:
    node = replicas()
    if node is not None:
        node.shutdown()


def quorum_moves(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    """Who left and who joined between two quorums, e.g. ``node1 left; node2, node3 joined``."""
    left = [node for node in before if node not in after]
    joined = [node for node in after if node not in before]
    moves = [f"{', '.join(left)} left"] if left else []
    moves += [f"{', '.join(joined)} joined"] if joined else []
    return "; ".join(moves)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``, so that a difference is named to the setting."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_NODE: ManagedReplicas | None = None


def node_replicas(config: FlexDeMoConfig, device=None) -> ManagedReplicas:
    """This process's one :class:`ManagedReplicas` (a process belongs to one quorum), built on first use."""
    global _NODE
    if _NODE is None:
        _NODE = ManagedReplicas(config, device=device)
    return _NODE


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB"
