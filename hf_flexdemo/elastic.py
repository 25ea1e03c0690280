"""Living under torchelastic (``torchrun`` / ``accelerate launch``): restarts and launcher death.

- :func:`restart_count`: which automatic restart this process belongs to (0: the first start).
- :func:`check_restart_setup`: refuse, before training, a restart setting that cannot work.
  torch's elastic agent keeps one TCPStore for the whole job when the rendezvous store is
  shared (``static`` backend, or ``c10d`` without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
  the restarted workers then read the dead workers' addresses from it and gloo/NCCL set-up
  fails with "Connection refused" (seen on torch 2.13). With ``c10d`` and sharing off, each
  round's rank 0 hosts a fresh store.
- :func:`exit_with_launcher`: a worker whose launcher is gone (SIGKILL of ``accelerate
  launch`` or of a node's agent) stops instead of training on unsupervised.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

RESTART_FIX = (
    "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the launcher's environment and use the c10d rendezvous: "
    "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 accelerate launch --rdzv_backend c10d --max_restarts N ...` "
    "(torchrun: --rdzv-backend c10d)"
)


def restart_count() -> int:
    """How many times torchelastic restarted this job's workers (0 outside torchelastic)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def check_restart_setup() -> None:
    """Raise ValueError if automatic restarts are asked for with a rendezvous store they cannot use."""
    if max_restarts() > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ValueError(
            f"--max_restarts={max_restarts()} cannot restart this job: the launcher shares one rendezvous store "
            f"across restarts, so restarted workers would read the dead workers' addresses. To restart, {RESTART_FIX}."
        )


_WATCHING = False


def exit_with_launcher(poll_seconds: float = 1.0) -> bool:
    """Stop this worker when its launcher (the parent process) dies; returns whether a watch started.

    A no-op outside torchelastic. A daemon thread polls the parent id: it changes when the
    launcher dies and the worker is re-parented. (Linux's parent-death signal would fire when
    the launcher's spawning *thread* ends, which is not the launcher's death.)
    """
    global _WATCHING
    if _WATCHING or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    watcher = threading.Thread(target=_watch_parent, args=(parent, poll_seconds), name="flexdemo-launcher-watch")
    watcher.daemon = True
    watcher.start()
    _WATCHING = True
    return True


def _watch_parent(parent: int, poll_seconds: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_seconds)
    print(f"hf_flexdemo: the launcher (pid {parent}) is gone; stopping this worker.", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)  # a handler that ignored SIGTERM: leave anyway
    os._exit(1)
