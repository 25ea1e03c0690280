"""What a node that heals receives from a live peer, and what it says about it.

A node that is behind (new, relaunched, or one that missed commits) takes, at its next quorum,
the state a peer serves: the parts registered with :meth:`Healing.register` (the optimizer's,
the Trainer's position), once the peer's settings and shapes (:meth:`Healing.describe`) were
found equal to its own. The optimizer's part is a copy of the state or the steps the node missed,
to replay (:mod:`.replica_state`, :mod:`.replay`); the node says which, with the bytes moved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..agreement import differences
from .lighthouse import read_lighthouse
from .node import FaultToleranceError, NodeIdentity
from .timeline import RoundClock

logger = logging.getLogger(__name__)

NODE_STATE_KEY = "flexdemo_node"
"""The first entry of the state a healing node receives: the peer's settings, checked before anything loads."""


class Healing:
    """The state this node serves to healing peers and takes from one, and its account of each heal."""

    def __init__(self, manager, identity: NodeIdentity, rank: int, clock: RoundClock):
        self._manager, self._identity, self._rank, self._clock = manager, identity, rank, clock
        self._state_fns: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._describers: dict[str, Callable[[], Any]] = {}
        self.healed = False
        """Whether this round took a peer's state."""
        self._catch_up: tuple[int, int, int] | None = None  # this round: (steps, bytes) replayed, bytes of a copy
        self._copied = 0  # this round: bytes of the whole state copied to this process
        self.catch_ups: list[tuple[int, int, int]] = []
        """Every catch-up by replay since this process started: (steps, bytes moved, bytes a full copy moves)."""
        # Registered first, so a healing node checks the peer's settings before loading anything.
        manager.register_state_dict_fn(NODE_STATE_KEY, self._check_peer, self._describe)

    def register(self, key: str, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Serve ``state()`` to nodes that heal from this one; ``load`` applies a peer's on this node.

        ``state()`` must return copies: torchft serves it while this node trains on. Registering a key again (a
        second Trainer in the process) replaces its functions."""
        if key not in self._state_fns:
            self._manager.register_state_dict_fn(key, lambda value: self._load(key, value), lambda: self._serve(key))
        self._state_fns[key] = (state, load)

    def _serve(self, key: str) -> Any:
        with self._clock.timing("serve"):
            return self._state_fns[key][0]()

    def _load(self, key: str, value: Any) -> None:
        try:
            self._state_fns[key][1](value)
        except FaultToleranceError:
            raise
        except Exception as e:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self._identity.name} could not take the live state ({key!r}) of a "
                f"peer: {type(e).__name__}: {e}"
            ) from e
        self.healed = True

    def describe(self, part: str, describe: Callable[[], Any]) -> None:
        """What must be equal on every node (settings, shapes): compared when a node first takes a peer's state."""
        self._describers[part] = describe

    def _describe(self) -> dict[str, Any]:
        return {part: fn() for part, fn in self._describers.items()} | {"node": self._identity.name}

    def _check_peer(self, peer: dict[str, Any]) -> None:
        ours = {k: v for k, v in self._describe().items() if k != "node"}
        theirs = {k: v for k, v in peer.items() if k != "node"}
        differ = differences(ours, theirs, "this node", str(peer.get("node")))
        if differ:
            raise FaultToleranceError(
                f"FlexDeMo fault tolerance: {self._identity.name} does not fit the running job and stops before "
                f"loading anything; launch it with the same settings and model as the others. Differences: "
                + "; ".join(differ)
            )

    # -- one round's heal ------------------------------------------------------------------

    def start_round(self) -> None:
        """A new quorum round: nothing taken yet."""
        self.healed = False
        self._catch_up, self._copied = None, 0

    def note_catch_up(self, steps: int, moved: int, copy: int) -> None:
        """This round's heal is a replay of ``steps`` missed steps (``moved`` bytes; a full copy: ``copy``)."""
        self._catch_up = (steps, moved, copy)

    def note_copy(self, copied: int) -> None:
        """This round's heal copied the whole state (``copied`` bytes to this process)."""
        self._copied = copied

    def healing_steps(self) -> list[int] | None:
        """Committed steps of the current quorum's nodes that are behind (None: the Lighthouse did not answer)."""
        view = read_lighthouse(self._identity.lighthouse)
        if view.error or not view.last_quorum:
            return None
        ahead = max(view.last_quorum.values())
        return [steps for steps in view.last_quorum.values() if steps < ahead]

    def say_healed(self) -> bool:
        """Once the round is joined: what this node took from a peer, in one line; returns whether it healed."""
        if self.healed and self._catch_up is not None:
            steps, moved, copy = self._catch_up
            self.catch_ups.append(self._catch_up)
            if self._rank == 0:  # said once: a node that is always late would say it every few steps
                say = logger.warning if len(self.catch_ups) == 1 else logger.debug
                say(
                    "FlexDeMo fault tolerance: %s missed %d committed step(s) and catches up by replaying their "
                    "exchanged payloads (%s on this process; copying the whole state would move %s). Later "
                    "catch-ups are counted in the run summary.",
                    self._identity.name,
                    steps,
                    _megabytes(moved),
                    _megabytes(copy),
                )
        elif self.healed:
            step = self._manager.current_step()
            # At step 0 every node takes the first node's initial parameters: nothing was lost.
            say = logger.warning if step > 0 and self._rank == 0 else logger.info
            say(
                "FlexDeMo fault tolerance: %s took the parameters and training position from a live peer "
                "(%d steps committed by the quorum; %s to this process) and trains on from there.",
                self._identity.name,
                step,
                _megabytes(self._copied),
            )
        return self.healed

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


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB"
