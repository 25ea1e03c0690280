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

What a healing node copies (:meth:`Healing.register <.healing.Healing.register>`): the parameters and the
state that must match across replicas (the optimizer's step count, DiLoCo's anchor and
outer momentum, and with the Trainer the global step and scheduler position). Its own
momentum is kept (zeros for a new node): DeMo momentum is per replica by design, and a
peer's holds the peer's unsent residual, which would be sent twice.

torchft is imported only when a :class:`ManagedReplicas` is built, never on the default path.

One idea per module:

- :mod:`.replicas`: :class:`ManagedReplicas`, the facade the optimizer and the Trainer talk to;
- :mod:`.node`: which node this is, torchft imported quietly, the ``Manager`` that joins the Lighthouse;
- :mod:`.quorum`: the step's quorum and its commit;
- :mod:`.membership`: who is live, and what the node says when that changes;
- :mod:`.healing`: what a healing node receives, and what it says about it;
- :mod:`.replica_state` and :mod:`.replay`: the optimizer's side of healing, by copy or by replay, and of
  undoing a step;
- :mod:`.closing`: the end of a job (closing rounds);
- :mod:`.rounds`: the wrapper around the optimizer's step (:func:`~.rounds.wrap_optimizer`,
  :class:`~.rounds.QuorumRounds`), and :mod:`.pipeline`: what it uses of the optimizer;
- :mod:`.collectives`: the exchange's collectives on the quorum's process group;
- :mod:`.lighthouse`: the Lighthouse client.
"""

# What the single module fault_tolerance.py gave before it became this package, from where it lives now.
from .collectives import ManagedTopology as ManagedTopology
from .lighthouse import LighthouseView as LighthouseView
from .lighthouse import job_state_verdict as job_state_verdict
from .lighthouse import lighthouse_status
from .lighthouse import node_of as node_of
from .lighthouse import read_lighthouse as read_lighthouse
from .membership import QuorumWatch as QuorumWatch
from .membership import quorum_moves as quorum_moves
from .node import LIGHTHOUSE_ENV as LIGHTHOUSE_ENV
from .node import NCCL_NONBLOCKING_TIMEOUT_ENV as NCCL_NONBLOCKING_TIMEOUT_ENV
from .node import FaultToleranceError, NodeIdentity, import_torchft
from .node import nccl_nonblocking_timeout as nccl_nonblocking_timeout
from .replicas import ManagedReplicas, node_replicas
from .rounds import QuorumRounds, managed_replicas, wrap_optimizer

__all__ = [
    "FaultToleranceError",
    "ManagedReplicas",
    "NodeIdentity",
    "import_torchft",
    "lighthouse_status",
    "node_replicas",
    "QuorumRounds",
    "managed_replicas",
    "wrap_optimizer",
]
