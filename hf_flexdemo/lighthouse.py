"""torchft as this project meets it: the node's identity, the import (quiet by default), what its Lighthouse says.

:class:`NodeIdentity` reads which node this is and where the Lighthouse is from the
environment, as torchft jobs set it. The Lighthouse keeps the last quorum it formed (each
member's committed steps) and who still heartbeats, on its ``/status`` page.
:func:`read_lighthouse` reads that page into a :class:`LighthouseView`: the waiting message
names who is missing, and a node that joins can tell whether the job had committed steps
that no live node holds any more (:func:`job_state_verdict`).

torchft's Rust side logs about 9 INFO lines per step to stderr. It reads ``RUST_LOG`` once,
when ``torchft._torchft`` is imported: :func:`import_torchft` imports it with ``RUST_LOG=warn``
unless ``RUST_LOG`` is set (``RUST_LOG=info`` brings torchft's lines back).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import urllib.request
from dataclasses import dataclass, field

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"
TORCHFT_LOG_ENV = "RUST_LOG"
QUIET_TORCHFT_LOG = "warn"


class FaultToleranceError(RuntimeError):
    """The quorum of nodes cannot go on: Lighthouse lost, too few nodes, or a node that does not fit."""


@dataclass(frozen=True)
class NodeIdentity:
    """Which node this is, and where the Lighthouse is: read from the environment, as torchft jobs set it."""

    lighthouse: str
    replica_group: int
    replica_groups: int

    @classmethod
    def from_env(cls, min_replicas: int = 1, environ: dict[str, str] | None = None) -> NodeIdentity:
        env = os.environ if environ is None else environ
        lighthouse = env.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise ValueError(
                f"fault_tolerance='torchft' needs the Lighthouse address in {LIGHTHOUSE_ENV} (unset). Start one with "
                f"`torchft_lighthouse --min_replicas 1 --bind [::]:29510` and write "
                f"{LIGHTHOUSE_ENV}=http://<its host>:29510 in every node's environment."
            )
        if not re.match(r"^https?://", lighthouse):
            raise ValueError(
                f"{LIGHTHOUSE_ENV}={lighthouse!r} is not an address torchft can reach; write it as "
                "http://<host>:<port>, e.g. http://10.0.0.1:29510."
            )
        groups = _env_int(env, REPLICA_GROUPS_ENV, "the number of nodes the job may have (fixes the data split)", 1)
        group = _env_int(env, REPLICA_GROUP_ENV, f"this node's index, 0 to {REPLICA_GROUPS_ENV} - 1", 0)
        if group >= groups:
            raise ValueError(
                f"{REPLICA_GROUP_ENV}={group} is invalid with {REPLICA_GROUPS_ENV}={groups}; it must be in "
                f"[0, {groups - 1}]. Give every node its own index."
            )
        if min_replicas > groups:
            raise ValueError(
                f"min_replicas={min_replicas} is more than {REPLICA_GROUPS_ENV}={groups} nodes: no step could ever "
                f"commit. Lower min_replicas or raise {REPLICA_GROUPS_ENV}."
            )
        return cls(lighthouse=lighthouse, replica_group=group, replica_groups=groups)

    @property
    def name(self) -> str:
        return f"node{self.replica_group}"


def _env_int(env, key: str, meaning: str, low: int) -> int:
    raw = env.get(key)
    if raw is None or not raw.strip().isdigit() or int(raw) < low:
        raise ValueError(
            f"fault_tolerance='torchft' needs {key}: {meaning}, an integer >= {low} (got {raw!r}). "
            f"Set it in each node's environment, e.g. {key}={low}."
        )
    return int(raw)


def import_torchft():
    """torchft's modules; its INFO lines stay out of the output unless ``RUST_LOG`` asks for them."""
    quiet = TORCHFT_LOG_ENV not in os.environ and "torchft._torchft" not in sys.modules
    if quiet:
        os.environ[TORCHFT_LOG_ENV] = QUIET_TORCHFT_LOG
    try:
        import torchft
        import torchft.manager
        import torchft.process_group
    except ImportError as e:
        raise FaultToleranceError(
            "fault_tolerance='torchft' needs the torchft package, which is not installed "
            f"({e}). Install it with `pip install 'hf-flexdemo[torchft]'` (torchft 0.2.0)."
        ) from e
    finally:
        if quiet:  # read once at import: nothing else in the process sees it
            del os.environ[TORCHFT_LOG_ENV]
    if quiet:  # its Python side too (on CPU it warns at every new quorum about NCCL's flight recorder)
        logging.getLogger("torchft").setLevel(logging.ERROR)
    return torchft


@dataclass(frozen=True)
class LighthouseView:
    """The Lighthouse's ``/status`` page: the last quorum it formed and who heartbeats.

    Replica ids are torchft's ``node<N>:<uuid>``: a relaunched node has a new uuid.
    """

    status: str = ""
    last_quorum: dict[str, int] = field(default_factory=dict)
    """Replica id -> committed steps, for each member of the last quorum."""
    heartbeating: frozenset[str] = frozenset()
    """Replica ids heard from within the Lighthouse's heartbeat timeout."""
    waiting: int = 0
    """Heartbeating nodes that have asked for the next quorum and wait for it to form."""
    error: str = ""
    """Why the page could not be read ("" when it was)."""

    @property
    def job_step(self) -> int:
        """The most steps a member of the last quorum had committed (0 before any quorum)."""
        return max(self.last_quorum.values(), default=0)

    def summary(self) -> str:
        """One line: the quorum status, and the last quorum's nodes that are live or missing."""
        if self.error:
            return self.error
        last = sorted({node_of(replica) for replica in self.last_quorum})
        alive = sorted({node_of(replica) for replica in self.heartbeating})
        missing = [node for node in last if node not in alive]
        return (
            f"{self.status or 'no quorum status on its page'}; last quorum {last or '[]'}, "
            f"heartbeating {alive or '[]'}, missing {missing or '[]'}"
        )


def node_of(replica_id: str) -> str:
    """``node1`` from torchft's ``node1:<uuid>``."""
    return replica_id.split(":", 1)[0]


def read_lighthouse(address: str, timeout: float = 2.0) -> LighthouseView:
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as reply:
            page = reply.read().decode("utf-8", "replace")
    except OSError as e:
        return LighthouseView(error=f"the Lighthouse at {address} does not answer ({e})")
    status = re.search(r"Next quorum status:\s*([^<]*)", page)
    previous = page.split("Previous Quorum", 1)[-1].split("Heartbeats", 1)[0] if "Previous Quorum" in page else ""
    members = re.findall(r"<b>\s*(node\d+:[^<\s]*)\s*</b>\s*<br/>\s*Step:\s*(\d+)", previous)
    beats = re.findall(r'<li class="heartbeat\s*(old)?\s*">\s*(node\d+:[^:\s<]*):', page.split("Heartbeats", 1)[-1])
    waiting = re.search(r"\[(\d+)/\d+ participants healthy\]", status.group(1) if status else "")
    return LighthouseView(
        status=status.group(1).strip() if status else "",
        last_quorum={replica: int(step) for replica, step in members},
        heartbeating=frozenset(replica for old, replica in beats if not old),  # "old": past the heartbeat timeout
        waiting=int(waiting.group(1)) if waiting else 0,
    )


def lighthouse_status(address: str, timeout: float = 2.0) -> str:
    """The Lighthouse's own account of the next quorum, and who heartbeats, in one line."""
    return read_lighthouse(address, timeout).summary()


class QuorumWatch:
    """Records which nodes each quorum holds (torchft's manager keeps only their count).

    It stands in for the manager's private client (``Manager._client``, whose ``_quorum``
    returns the Lighthouse's answer; torchft 0.2.0, checked by tests/test_fault_tolerance.py)
    and passes every call through.
    """

    def __init__(self, manager):
        self._client = manager._client
        self.members: tuple[str, ...] = ()
        """Node names of the latest quorum, sorted (empty before the first)."""
        manager._client = self

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        self.members = tuple(sorted(node_of(replica) for replica in quorum.replica_ids))
        return quorum

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def job_state_verdict(
    before: LighthouseView, now: LighthouseView, name: str, step: int, resumed: bool
) -> tuple[str, str] | None:
    """What a node does when its first quorum holds fewer committed steps than the Lighthouse's last one.

    ``before``: the Lighthouse's view before the node joined; ``now``: after; ``step``: the
    quorum's committed steps (the node's own after healing); ``resumed``: whether the node
    continues from a checkpoint. ``None``: go on (a node that holds the steps still heartbeats,
    only late, and will heal this one); ``("refuse", why)``: it would quietly start the job over;
    ``("warn", what)``: it continues from its checkpoint, behind.
    """
    others = {replica for replica in before.last_quorum if node_of(replica) != name}
    if before.job_step <= step or others & now.heartbeating:
        return None
    held = ", ".join(f"{node_of(replica)} at {steps}" for replica, steps in sorted(before.last_quorum.items()))
    if step == 0 and not resumed:
        return "refuse", (
            f"FlexDeMo fault tolerance: {name} joins a job whose last quorum had committed {before.job_step} steps "
            f"({held}), but none of those nodes is live and this node holds none of them: it would train a fresh "
            "model from step 0. To continue the job, relaunch a node that holds its state first, or resume this node "
            "from its checkpoint (the Trainer resumes from the checkpoints in its output_dir by itself; "
            "--resume_from_checkpoint PATH names one); to start a new job, restart torchft_lighthouse."
        )
    return "warn", (
        f"FlexDeMo fault tolerance: {name} resumes from its checkpoint at {step} committed steps, behind the "
        f"{before.job_step} of the job's last quorum ({held}), none of whose nodes is live: the steps between are "
        "lost unless one of them returns (this node then heals from it)."
    )
