"""The Lighthouse client: what torchft's Lighthouse says on its status page.

The Lighthouse keeps the last quorum it formed (each member's committed steps) and who
still heartbeats, on its ``/status`` page. :func:`read_lighthouse` reads that page into a
:class:`LighthouseView`: the waiting message names who is missing, a node that finished
training sees whether a late node waits for a closing round, and a node that joins can tell
whether the job had committed steps that no live node holds any more (:func:`job_state_verdict`).
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field


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
