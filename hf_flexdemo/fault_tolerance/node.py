"""This node: which one it is, torchft imported quietly, and the torchft ``Manager`` that joins the Lighthouse.

:class:`NodeIdentity` reads which node this is and where the Lighthouse is from the
environment, as torchft jobs set it.

torchft's Rust side logs about 9 INFO lines per step to stderr. It reads ``RUST_LOG`` once,
when ``torchft._torchft`` is imported: :func:`import_torchft` imports it with ``RUST_LOG=warn``
unless ``RUST_LOG`` is set (``RUST_LOG=info`` brings torchft's lines back).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import FlexDeMoConfig

logger = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"
TORCHFT_LOG_ENV = "RUST_LOG"
QUIET_TORCHFT_LOG = "warn"
NCCL_NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"


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


def nccl_nonblocking_timeout(ft_timeout: float) -> None:
    """Bound NCCL's non-blocking operations by ``ft_timeout``, unless the user set the variable.

    torchft's NCCL group sets this variable to its own timeout when it is unset, with a warning at
    every node start; set first, it holds the same value and the start says nothing.
    """
    os.environ.setdefault(NCCL_NONBLOCKING_TIMEOUT_ENV, str(float(ft_timeout)))


def start_manager(torchft, config: FlexDeMoConfig, identity: NodeIdentity, device: torch.device):
    """This process's torchft ``Manager``, joined to the Lighthouse: ``(manager, process group, store)``.

    The process group is the one exchanges run on (torchft's NCCL group on CUDA, gloo otherwise);
    the store is one made here for a process that no launcher gave one (``None`` otherwise).
    """
    timeout = timedelta(seconds=config.ft_timeout)
    group_class = (
        torchft.process_group.ProcessGroupNCCL if device.type == "cuda" else torchft.process_group.ProcessGroupGloo
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    store = store_addr = store_port = None
    if "MASTER_ADDR" not in os.environ:  # one process, not launched by torchrun: the manager needs a store
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_addr, store_port = "127.0.0.1", store.port
    if device.type == "cuda":
        nccl_nonblocking_timeout(config.ft_timeout)
    group = group_class(timeout=timeout)
    try:
        manager = torchft.manager.Manager(
            pg=group,
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
            lighthouse_addr=identity.lighthouse,
            replica_id=identity.name,
            init_sync=True,  # step 0: every node starts from the first node's parameters
        )
    except Exception as e:
        raise FaultToleranceError(
            f"FlexDeMo fault tolerance: {identity.name} could not join the Lighthouse at "
            f"{LIGHTHOUSE_ENV}={identity.lighthouse} within ft_timeout={config.ft_timeout:g} s: {e}. Check "
            "that torchft_lighthouse runs there and that this node can reach it."
        ) from e
    logger.info(
        "FlexDeMo fault tolerance: %s (rank %d of %d) joined the Lighthouse at %s; min_replicas=%d.",
        identity.name,
        rank,
        world,
        identity.lighthouse,
        config.min_replicas,
    )
    return manager, group, store
