"""Crash-safe Trainer checkpoints of FlexDeMo runs: a completion marker, resume from the newest complete one.

A Trainer with another optimizer keeps the stock checkpoints and resume: ``import hf_flexdemo`` adds neither
the marker nor the resume rules below to it (``integrations/trainer.py`` hands it the stock methods).

The Trainer writes ``checkpoint-N`` file by file from every process, with no step that says
"done": a process killed mid-save leaves a directory that looks like a checkpoint (and
``get_last_checkpoint`` picks it by step number). Here a checkpoint counts only once
:class:`CheckpointCallback` has written :data:`MARKER` into it, after every process has
finished writing (a barrier) and the files are flushed to disk; the marker lists every file
and its size, so truncation after the fact is noticed too.

- :func:`resolve_resume` turns ``resume_from_checkpoint`` (``"auto"``/``True``, a path, or
  nothing) into the checkpoint to load, and removes the incomplete ones it skipped; asked for
  nothing, it resumes an earlier run it finds in ``output_dir`` rather than overwrite it;
- :func:`storage_errors` turns a full disk or a read-only output directory into one short
  :class:`CheckpointStorageError` that says what is whole on disk.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from transformers import TrainerCallback

from .. import elastic

logger = logging.getLogger(__name__)

MARKER = "flexdemo_checkpoint_complete.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR-<step>
AUTO = "auto"
STORAGE_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
}
STORAGE_TEXTS = {  # the same causes where only a message survives (torch's C++ writers, DCP's gathered failures)
    "No space left on device": "the disk is full",
    "file write failed": "the disk is full",
    "Read-only file system": "the file system is read-only",
    "Disk quota exceeded": "the disk quota is used up",
}
# torch's zip writer says only this when a write came up short; the errno is lost (DCP pickles each
# rank's failure without its context), so the output directory's free space tells whether it was full.
SHORT_WRITE = re.compile(r"inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+")
SHORT = "a write came up short"
FULL_BELOW = 64 * 2**20  # bytes free under which a disk counts as full (or 1% of it, if less)


class CheckpointStorageError(OSError):
    """Writing a checkpoint or the model failed for a storage reason (full, read-only, no rights).

    ``cause`` is the short reason ("the disk is full (No space left on device)"). ``every_rank``:
    every process raised it at the same point (a distributed checkpoint's failure, a decision
    broadcast by rank 0), so they can still meet; otherwise this process failed alone.
    """

    def __init__(self, message: str, cause: str = "", every_rank: bool = False):
        super().__init__(message)
        self.cause = cause
        self.every_rank = every_rank


# -- one checkpoint ------------------------------------------------------------------------


def checkpoint_files(folder: Path) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``folder`` except the marker."""
    return {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MARKER
    }


def write_marker(folder: Path, step: int) -> None:
    """Flush every file of ``folder`` to disk, then mark it complete (atomically)."""
    files = checkpoint_files(folder)
    for name in files:
        _fsync(folder / name)
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync(tmp)
    os.replace(tmp, folder / MARKER)
    _fsync(folder)


def incomplete_reason(folder: Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or ``None`` if it is."""
    marker = folder / MARKER
    if not marker.is_file():
        return "no completion marker (the save was interrupted)"
    try:
        listed = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, OSError) as error:
        return f"unreadable completion marker ({error})"
    for name, size in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when it was saved"
    return None


def is_complete(folder: Path) -> bool:
    return incomplete_reason(folder) is None


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` directory in ``run_dir``, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def newest_complete(run_dir: Path) -> Path | None:
    complete = [folder for _, folder in checkpoints(run_dir) if is_complete(folder)]
    return complete[-1] if complete else None


def remove_incomplete(run_dir: Path) -> list[str]:
    """Delete every incomplete ``checkpoint-N`` of ``run_dir``; returns ``"name (reason)"`` for each."""
    removed = []
    for _, folder in checkpoints(run_dir):
        reason = incomplete_reason(folder)
        if reason is not None:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(f"{folder.name} ({reason})")
    return removed


def rotate(run_dir: Path, limit: int | None, best: str | None) -> list[str]:
    """Keep at most ``limit`` complete checkpoints, always the newest and the best; returns the deleted."""
    if not limit or limit <= 0:
        return []
    complete = [folder for _, folder in checkpoints(run_dir) if is_complete(folder)]
    protected = {complete[-1]} if complete else set()
    if best:
        protected.add(Path(best))
    deletable = [folder for folder in complete if folder not in protected]
    excess = len(complete) - max(limit, len(protected))
    deleted = deletable[: max(excess, 0)]
    for folder in deleted:
        shutil.rmtree(folder, ignore_errors=True)
    return [folder.name for folder in deleted]


# -- resuming ------------------------------------------------------------------------------


def resolve_resume(
    run_dir: str | os.PathLike, request: str | bool | None, *, overwrite: bool | None = None
) -> str | None:
    """The checkpoint to resume from for ``request``, the same on every process.

    ``"auto"`` or ``True``: the newest complete checkpoint in ``run_dir`` (incomplete ones are
    removed and named in the log), or ``None`` for a fresh start. A path: that checkpoint,
    which must be complete. ``None``/``False`` (not asked): a fresh start in an empty
    ``run_dir``; with an earlier run's complete checkpoints there, resume from the newest
    one (a relaunched job continues instead of overwriting them), as after an automatic
    restart. ``overwrite``: transformers 4.x's ``overwrite_output_dir`` (``None`` where the
    version has no such setting); ``True`` removes the earlier checkpoints and starts over.
    The main process decides (and checks that ``run_dir`` can be written) and tells the
    others, so that all of them raise together.
    """
    restarts = _job_restart_count()
    if not request and restarts > 0:
        logger.warning(
            "Automatic restart (restart %d of a launcher): resuming from the newest complete checkpoint.", restarts
        )
        request = AUTO
    decision: list = [None]
    if _rank() == 0:
        try:
            check_writable(run_dir)
            decision[0] = _decide(Path(run_dir), request) if request else _decide_unasked(Path(run_dir), overwrite)
        except CheckpointStorageError as error:
            decision[0] = ("unwritable", str(error))
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(decision, src=0)
    kind, value = decision[0]
    if kind == "unwritable":
        raise CheckpointStorageError(value, "the output directory cannot be written", every_rank=True)
    if kind == "error":
        raise ValueError(value)
    return value


def _decide(run_dir: Path, request: str | bool) -> tuple[str, str | None]:
    if request is True or request == AUTO:
        removed = remove_incomplete(run_dir)
        if removed:
            logger.warning("Skipped and removed incomplete checkpoints in %s: %s", run_dir, ", ".join(removed))
        chosen = newest_complete(run_dir)
        if chosen is None:
            logger.warning("No complete checkpoint in %s: starting from step 0.", run_dir)
            return "ok", None
        logger.warning("Resuming from %s, the newest complete checkpoint.", chosen)
        return "ok", str(chosen)
    folder = Path(request)
    reason = incomplete_reason(folder) if folder.is_dir() else "it does not exist"
    if reason is None:
        return "ok", str(folder)
    if folder.is_dir() and not (folder / MARKER).exists() and (folder / "trainer_state.json").is_file():
        logger.warning(
            "%s has no completion marker (saved by a run without FlexDeMo?); resuming from it as asked.", folder
        )
        return "ok", str(folder)
    newest = newest_complete(folder.parent)
    instead = f"--resume_from_checkpoint {newest}" if newest else "no --resume_from_checkpoint (a fresh start)"
    return "error", (
        f"--resume_from_checkpoint={request!r} is not a complete checkpoint: {reason}. "
        f"Use --resume_from_checkpoint auto (the newest complete one), or write {instead}."
    )


def _decide_unasked(run_dir: Path, overwrite: bool | None) -> tuple[str, str | None]:
    """No resume asked for: never let a fresh start overwrite what an earlier run saved in ``run_dir``."""
    found = [folder for _, folder in checkpoints(run_dir)]
    if not found:
        return "ok", None
    names = ", ".join(folder.name for folder in found)
    if overwrite:
        for folder in found:
            shutil.rmtree(folder, ignore_errors=True)  # stale markers must not vouch for a half-rewritten folder
        logger.warning("overwrite_output_dir=True: removed %s from %s; training starts from step 0.", names, run_dir)
        return "ok", None
    start_over = "remove {} (or choose another --output_dir)" + (
        " or pass --overwrite_output_dir" if overwrite is not None else ""
    )
    complete = newest_complete(run_dir)
    if complete is not None:
        removed = remove_incomplete(run_dir)
        skipped = f" (removed the incomplete {', '.join(removed)})" if removed else ""
        kept = ", ".join(folder.name for _, folder in checkpoints(run_dir))
        logger.warning(
            "Resuming from %s, the newest complete checkpoint of an earlier run in %s%s; to start over instead, %s.",
            complete,
            run_dir,
            skipped,
            start_over.format(kept),
        )
        return "ok", str(complete)
    # Without our marker a folder may still be a whole checkpoint saved by a run without FlexDeMo.
    stock = [folder.name for folder in found if (folder / "trainer_state.json").is_file()]
    if stock:
        return "error", (
            f"output_dir={str(run_dir)!r} holds {', '.join(stock)} without hf_flexdemo's completion marker (saved "
            "by a run without FlexDeMo, or a save that was interrupted), and training from step 0 would overwrite it. "
            f"Write --resume_from_checkpoint {run_dir / stock[-1]} to resume from it as it is, "
            f"--resume_from_checkpoint auto to discard it as interrupted and start from step 0, or "
            f"{start_over.format(', '.join(stock))}."
        )
    removed = remove_incomplete(run_dir)
    logger.warning("Removed interrupted saves in %s: %s; starting from step 0.", run_dir, ", ".join(removed))
    return "ok", None


# -- saving --------------------------------------------------------------------------------


class CheckpointCallback(TrainerCallback):
    """Marks each checkpoint complete once every process wrote it; rotates only complete ones.

    Added to every FlexDeMo Trainer by ``import hf_flexdemo``. It also settles which checkpoint is the
    best one after the barrier (the Trainer decides it per process while the save is still
    being written, so processes could disagree), and applies ``save_total_limit`` itself,
    after the marker, so that a crash never leaves fewer complete checkpoints than asked for.
    """

    def __init__(self):
        self._limit: int | None = None

    def on_train_begin(self, args, state, control, **kw):
        # The Trainer would rotate before the new checkpoint is complete; we rotate after.
        self._limit, args.save_total_limit = args.save_total_limit, None

    def on_save(self, args, state, control, **kw):
        run_dir = Path(args.output_dir)
        folder = run_dir / f"checkpoint-{state.global_step}"
        _barrier()  # every process has written its files
        if state.best_global_step:
            best = run_dir / f"checkpoint-{state.best_global_step}"
            if best == folder or is_complete(best):
                state.best_model_checkpoint = str(best)
        if args.should_save:
            state.save_to_json(str(folder / "trainer_state.json"))  # with the settled best checkpoint
            write_marker(folder, state.global_step)
            deleted = rotate(run_dir, self._limit, state.best_model_checkpoint)
            if deleted:
                logger.info("save_total_limit=%s: deleted %s", self._limit, ", ".join(deleted))
        _barrier()  # nobody moves on (or dies) believing a checkpoint is complete before it is

    def on_train_end(self, args, state, control, **kw):
        args.save_total_limit = self._limit  # rotation already ran at each save; the newest is kept too


@contextlib.contextmanager
def storage_errors(run_dir: str | os.PathLike):
    """Turn a full disk, a quota or a read-only output directory into one short error."""
    try:
        yield
    except CheckpointStorageError:
        raise
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        cause = None if isinstance(error, (KeyboardInterrupt, SystemExit)) else storage_cause(error, run_dir)
        if cause is None:
            raise
        run_dir = Path(run_dir)
        every_rank = _world_size() == 1 or _raised_on_every_rank(error)
        if every_rank:  # nobody writes any more: rank 0 can remove the half-written checkpoint
            removed = remove_incomplete(run_dir) if _rank() == 0 else []
            cleaned = f"; removed the incomplete {', '.join(removed)}" if removed else ""
        else:  # the other processes may still be writing into it: resuming removes it
            left = [folder.name for _, folder in checkpoints(run_dir) if not is_complete(folder)]
            cleaned = f"; the incomplete {', '.join(left)} is removed when you resume" if left else ""
        newest = newest_complete(run_dir)
        kept = f"the newest complete checkpoint, {newest}, is whole" if newest else "no checkpoint was complete yet"
        fix = (
            "Check that disk (space, quota, I/O errors)"
            if cause.startswith(SHORT)
            else "Free space (or fix the rights)"
        )
        raise CheckpointStorageError(
            f"Writing to {run_dir.resolve()} failed on rank {_rank()}: {cause}. Nothing complete was lost: "
            f"{kept}{cleaned}. {fix}, then resume with --resume_from_checkpoint auto.",
            cause,
            every_rank,
        ) from None


def exit_on_storage_error(error: CheckpointStorageError) -> NoReturn:
    """Stop this process with ``error`` said once, in full, by a process that is not stopped first.

    The launcher stops every worker as soon as one exits. When every process failed together,
    rank 0 says it and the others wait for it at a barrier before they exit. A process that
    failed alone says it itself: its peers wait in a collective it will never join.
    """
    rank = _rank()
    if not error.every_rank:
        raise SystemExit(str(error))
    if rank == 0:
        print(error, file=sys.stderr, flush=True)
    _barrier()
    raise SystemExit(1 if rank == 0 else f"rank {rank}: {error.cause or error}")


def storage_cause(error: BaseException, run_dir: str | os.PathLike | None = None) -> str | None:
    """A short storage cause found anywhere in ``error``'s chain (DCP's per-rank failures included).

    A write that came up short, with no reason left, is put down to ``run_dir``'s disk when that
    disk is full now; otherwise it is still a storage failure, said as it is.
    """
    short_write = False
    for current in _chain(error):
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            return f"{STORAGE_ERRNOS[current.errno]} ({current.strerror})"
        for text, cause in STORAGE_TEXTS.items():
            if text in str(current):
                return f"{cause} ({text})"
        short_write = short_write or SHORT_WRITE.search(str(current)) is not None
    if not short_write:
        return None
    # torch's own words ("inline_container.cc ... unexpected pos") say nothing to a user: left out.
    if run_dir is not None and _disk_is_full(Path(run_dir)):
        return f"the disk is full ({SHORT})"
    return SHORT


def _disk_is_full(path: Path) -> bool:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        disk = os.statvfs(path)
    except OSError:
        return False
    return disk.f_bavail * disk.f_frsize < min(FULL_BELOW, disk.f_blocks * disk.f_frsize // 100)


def _raised_on_every_rank(error: BaseException) -> bool:
    """A distributed checkpoint's failure: DCP gathers every rank's outcome and raises the same on all."""
    from torch.distributed.checkpoint.api import CheckpointException

    return any(isinstance(current, CheckpointException) for current in _chain(error))


def _chain(error: BaseException):
    """``error``, its causes and contexts, and the per-rank failures a DCP CheckpointException holds."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)  # DCP's CheckpointException: {rank: (exception, trace)}
        if isinstance(failures, dict):
            for failure in failures.values():
                items = failure if isinstance(failure, tuple) else (failure,)
                pending.extend(f for f in items if isinstance(f, BaseException))
        pending.extend([current.__cause__, current.__context__])


def check_writable(run_dir: str | os.PathLike) -> None:
    """Refuse before training when ``output_dir`` cannot be written (call it on the main process)."""
    run_dir = Path(run_dir)
    probe = run_dir / f".flexdemo_write_probe.{socket.gethostname()}.{os.getpid()}"  # every process its own
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise CheckpointStorageError(
            f"output_dir={str(run_dir)!r} cannot be written ({error.strerror or error}). Checkpoints and the model "
            "go there: choose a writable --output_dir."
        ) from None


# -- helpers -------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _job_restart_count() -> int:
    """The highest restart count of any process: on several nodes, only the agent whose worker
    failed counts a restart; the other nodes' workers join the new round with their old count."""
    count = elastic.restart_count()
    if dist.is_available() and dist.is_initialized():
        counts: list = [None] * dist.get_world_size()
        dist.all_gather_object(counts, count)
        count = max(counts)
    return count


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
