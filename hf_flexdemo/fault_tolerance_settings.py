"""The settings of live fault tolerance on torchft (:mod:`hf_flexdemo.fault_tolerance`): one group of
:class:`hf_flexdemo.FlexDeMoConfig`'s settings, which imports nothing of torchft."""

from __future__ import annotations

from dataclasses import dataclass, field

from .group_settings import check_choice, check_float, check_int

REPLAY_STEPS_DEFAULT = 32
"""Under torchft: enough for a node the others keep waiting for to sit out a few seconds and come back by replay."""
STALL_WAIT_DEFAULT = 5.0
JOIN_QUORUM = ("before_forward", "when_ready")
JOIN_QUORUM_DEFAULT = "when_ready"
"""Under torchft: a slow node is left out of the steps it is late for instead of holding every quorum."""
FAULT_TOLERANCE = ("off", "torchft")


@dataclass(kw_only=True)
class FaultToleranceSettings:
    """Live fault tolerance on torchft: the quorum, its time limits, and how a slow or lagging node catches up."""

    fault_tolerance: str = field(
        default="off",
        metadata={
            "help": "'torchft': each node is its own job and the replicas meet in a torchft quorum every step, so "
            "a lost node never stops the others (needs TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS)."
        },
    )
    min_replicas: int = field(
        default=1, metadata={"help": "torchft: fewest live nodes a step commits with; fewer and the others wait."}
    )
    ft_timeout: float = field(
        default=30.0,
        metadata={
            "help": "torchft: seconds an exchange or recovery may take before it counts as lost (a commit vote: twice)."
        },
    )
    quorum_timeout: float = field(
        default=120.0,
        metadata={"help": "torchft: seconds to wait for min_replicas live nodes (or the Lighthouse) before stopping."},
    )
    join_quorum: str | None = field(
        default=None,
        metadata={
            "help": "torchft: when a node joins each step's quorum. 'when_ready' (the default): once its payload is "
            "ready, so a late node misses the steps it is late for and catches up by replay; 'before_forward': "
            "every node waits for the slowest."
        },
    )
    stall_wait: float | None = field(
        default=None,
        metadata={
            "help": "torchft: after its processes stalled (0.5 s or more not running), a node asks for its next quorum "
            "only once it has run this many seconds (default 5) without one, then catches up. 0: it never sits out."
        },
    )
    replay_steps: int | None = field(
        default=None,
        metadata={
            "help": "torchft: each node keeps the last N committed steps' payloads (default 32), so a node that "
            "missed up to N commits replays them instead of copying the whole state (0: always copy)."
        },
    )

    def _check_fault_tolerance(self) -> None:
        """``join_quorum``, ``replay_steps`` and ``stall_wait`` given without torchft are refused whatever their value
        (``None`` is "not given"); not given under torchft, they take the settings that keep a slow node from
        slowing the others (:meth:`_resolve_fault_tolerance`)."""
        check_choice("fault_tolerance", self.fault_tolerance, FAULT_TOLERANCE)
        check_int("min_replicas", self.min_replicas, low=1)
        check_float("ft_timeout", self.ft_timeout, low=0.0, low_open=True)
        check_float("quorum_timeout", self.quorum_timeout, low=0.0, low_open=True)
        if self.join_quorum is not None:
            check_choice("join_quorum", self.join_quorum, JOIN_QUORUM)
        if self.replay_steps is not None:
            check_int("replay_steps", self.replay_steps, low=0)
        if self.stall_wait is not None:
            check_float("stall_wait", self.stall_wait, low=0.0)
        applies_to = {
            "join_quorum": "when a node joins a step's quorum",
            "replay_steps": "a lagging node's catch-up",
            "stall_wait": "when a node that stalled asks for its next quorum",
        }
        for name, what in applies_to.items():
            value = getattr(self, name)
            if value is not None and not self.fault_tolerant:
                shown = f"{value:g}" if isinstance(value, float) else repr(value)
                raise ValueError(
                    f"FlexDeMo: {name}={shown} applies to fault_tolerance='torchft' ({what}), but fault_tolerance "
                    f"is 'off'; drop {name}, or set fault_tolerance=torchft."
                )

    def _resolve_fault_tolerance(self) -> None:
        """Once every given value is checked: the settings not given take their defaults."""
        if self.join_quorum is None:
            self.join_quorum = JOIN_QUORUM_DEFAULT if self.fault_tolerant else "before_forward"
        if self.replay_steps is None:
            self.replay_steps = REPLAY_STEPS_DEFAULT if self.fault_tolerant else 0
        if self.stall_wait is None:
            self.stall_wait = STALL_WAIT_DEFAULT if self.fault_tolerant else 0.0

    @property
    def fault_tolerant(self) -> bool:
        return self.fault_tolerance != "off"
