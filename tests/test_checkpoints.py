"""Checkpoint completeness, resume resolution, rotation and error classification, in one process."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from hf_flexdemo import elastic
from hf_flexdemo.integrations import checkpoints as checkpoints_module
from hf_flexdemo.integrations.checkpoints import (
    MARKER,
    CheckpointStorageError,
    check_writable,
    exit_on_storage_error,
    incomplete_reason,
    newest_complete,
    resolve_resume,
    rotate,
    storage_cause,
    storage_errors,
    write_marker,
)

pytestmark = [pytest.mark.unit, pytest.mark.lowest]


def make_checkpoint(run_dir, step, complete=True):
    folder = run_dir / f"checkpoint-{step}"
    (folder / "optimizer_0").mkdir(parents=True)
    (folder / "optimizer_0" / "__0_0.distcp").write_bytes(b"x" * (100 + step))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        write_marker(folder, step)
    return folder


def test_a_marked_checkpoint_is_complete_until_a_file_is_truncated_or_missing(tmp_path):
    folder = make_checkpoint(tmp_path, 1)
    assert incomplete_reason(folder) is None
    assert json.loads((folder / MARKER).read_text())["files"]["optimizer_0/__0_0.distcp"] == 101
    (folder / "optimizer_0" / "__0_0.distcp").write_bytes(b"x" * 10)
    assert "has 10 bytes, 101 when it was saved" in incomplete_reason(folder)
    (folder / "optimizer_0" / "__0_0.distcp").unlink()
    assert "is missing" in incomplete_reason(folder)
    assert "no completion marker" in incomplete_reason(make_checkpoint(tmp_path, 2, complete=False))


def test_auto_resume_takes_the_newest_complete_checkpoint_and_removes_the_rest(tmp_path, caplog):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 10)
    truncated = make_checkpoint(tmp_path, 11)
    (truncated / "trainer_state.json").write_text("{")
    make_checkpoint(tmp_path, 12, complete=False)
    with caplog.at_level("WARNING"):
        assert resolve_resume(tmp_path, "auto") == str(tmp_path / "checkpoint-10")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-2"]
    assert "checkpoint-11 (trainer_state.json has 1 bytes" in caplog.text
    assert "checkpoint-12 (no completion" in caplog.text
    assert resolve_resume(tmp_path, True) == str(tmp_path / "checkpoint-10")


def test_auto_resume_with_no_complete_checkpoint_starts_fresh(tmp_path):
    make_checkpoint(tmp_path, 1, complete=False)
    assert resolve_resume(tmp_path, "auto") is None
    assert not list(tmp_path.iterdir())
    assert resolve_resume(tmp_path / "missing", "auto") is None
    assert resolve_resume(tmp_path, None) is None


def test_an_automatic_restart_resumes_by_default(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, 3)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resolve_resume(tmp_path, None) == str(tmp_path / "checkpoint-3")


def test_an_earlier_runs_complete_checkpoints_are_resumed_not_overwritten(tmp_path, caplog):
    """A crashed job relaunched with the same command (no resume asked for) continues from its newest complete save."""
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 8, complete=False)  # killed mid-save
    with caplog.at_level("WARNING"):
        assert resolve_resume(tmp_path, None) == str(tmp_path / "checkpoint-4")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "Resuming from" in said[0] and "removed the incomplete checkpoint-8" in said[0]
    assert "to start over instead, remove checkpoint-4 (or choose another --output_dir)" in said[0]
    assert "--overwrite_output_dir" not in said[0]  # transformers 5.x has no such setting
    assert resolve_resume(tmp_path, False, overwrite=False) == str(tmp_path / "checkpoint-4")
    assert "or pass --overwrite_output_dir" in caplog.records[-1].getMessage()  # 4.x has it


def test_overwrite_output_dir_starts_over_without_stale_markers(tmp_path):
    make_checkpoint(tmp_path, 4)
    assert resolve_resume(tmp_path, None, overwrite=True) is None
    assert not (tmp_path / "checkpoint-4").exists()


def test_unmarked_checkpoints_are_never_overwritten_silently(tmp_path):
    make_checkpoint(tmp_path, 6, complete=False)  # a stock save, or an interrupted one: no way to tell
    with pytest.raises(ValueError, match=r"holds checkpoint-6 without hf_flexdemo's completion marker") as caught:
        resolve_resume(tmp_path, None)
    assert "--resume_from_checkpoint auto" in str(caught.value) and "checkpoint-6 to resume" in str(caught.value)
    assert (tmp_path / "checkpoint-6").exists()
    (tmp_path / "checkpoint-6" / "trainer_state.json").unlink()  # not resumable by anyone: an interrupted save
    assert resolve_resume(tmp_path, None) is None
    assert not (tmp_path / "checkpoint-6").exists()


def test_an_explicit_incomplete_checkpoint_is_refused_with_the_alternative(tmp_path):
    make_checkpoint(tmp_path, 4)
    broken = make_checkpoint(tmp_path, 5)
    (broken / "optimizer_0" / "__0_0.distcp").unlink()
    missing = r"checkpoint-5.*not a complete checkpoint: optimizer_0/__0_0.distcp is missing"
    with pytest.raises(ValueError, match=missing):
        resolve_resume(tmp_path, str(broken))
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint .*checkpoint-4"):
        resolve_resume(tmp_path, str(broken))
    assert resolve_resume(tmp_path, str(tmp_path / "checkpoint-4")) == str(tmp_path / "checkpoint-4")


def test_a_checkpoint_saved_without_the_marker_is_resumed_when_named(tmp_path):
    legacy = make_checkpoint(tmp_path, 7, complete=False)
    assert resolve_resume(tmp_path, str(legacy)) == str(legacy)


def test_rotation_counts_only_complete_checkpoints_and_keeps_the_newest_and_the_best(tmp_path):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 5, complete=False)
    assert rotate(tmp_path, 2, best=str(tmp_path / "checkpoint-1")) == ["checkpoint-2", "checkpoint-3"]
    assert newest_complete(tmp_path) == tmp_path / "checkpoint-4"
    assert (tmp_path / "checkpoint-1").exists() and (tmp_path / "checkpoint-5").exists()
    assert rotate(tmp_path, None, best=None) == []


@pytest.mark.parametrize(
    "error,cause",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "the disk is full"),
        (
            RuntimeError("[enforce fail at inline_container.cc:626] file write failed"),
            "disk is full",
        ),
        (OSError(errno.EROFS, "Read-only file system"), "read-only"),
    ],
)
def test_storage_causes_are_found_through_chains(error, cause):
    try:
        try:
            raise error
        except Exception as inner:
            raise RuntimeError("CheckpointException ranks:dict_keys([2])") from inner
    except RuntimeError as outer:
        assert cause in storage_cause(outer)
    assert storage_cause(ValueError("shape mismatch")) is None


def test_storage_errors_name_what_is_whole_and_remove_the_half_written(tmp_path):
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2, complete=False)
    with pytest.raises(CheckpointStorageError) as caught:
        with storage_errors(tmp_path):
            raise OSError(errno.ENOSPC, "No space left on device")
    message = str(caught.value)
    assert "the disk is full" in message and "checkpoint-1, is whole" in message and "checkpoint-2" in message
    assert not (tmp_path / "checkpoint-2").exists()
    with pytest.raises(KeyError), storage_errors(tmp_path):  # anything else passes through
        raise KeyError("x")


def test_a_failure_of_one_process_among_several_keeps_what_its_peers_may_still_write(tmp_path, monkeypatch):
    """A plain write error is this process's alone: the others may still be writing checkpoint-2."""
    make_checkpoint(tmp_path, 1)
    make_checkpoint(tmp_path, 2, complete=False)
    monkeypatch.setattr(checkpoints_module, "_world_size", lambda: 2)
    with pytest.raises(CheckpointStorageError) as caught, storage_errors(tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")
    message = str(caught.value)
    assert not caught.value.every_rank
    assert "checkpoint-1, is whole" in message and "the incomplete checkpoint-2 is removed when you resume" in message
    assert (tmp_path / "checkpoint-2").exists()


def test_a_storage_error_of_every_process_is_said_by_rank_0_before_any_process_exits(monkeypatch, capsys):
    """The launcher stops every worker at the first exit: the others leave only after rank 0 has spoken."""
    from torch.distributed.checkpoint.api import CheckpointException

    events = []
    monkeypatch.setattr(checkpoints_module, "_world_size", lambda: 2)
    monkeypatch.setattr(checkpoints_module, "_barrier", lambda: events.append(("barrier", capsys.readouterr().err)))
    for rank in (1, 0):
        monkeypatch.setattr(checkpoints_module, "_rank", lambda rank=rank: rank)
        failure = CheckpointException("write", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
        with pytest.raises(CheckpointStorageError) as caught, storage_errors("/nonexistent/run"):
            raise failure
        assert caught.value.every_rank  # DCP raises the same failure on every rank
        with pytest.raises(SystemExit) as exited:
            exit_on_storage_error(caught.value)
        events.append(("exit", exited.value.code))
    rank1, rank0 = events[:2], events[2:]
    assert rank1 == [("barrier", ""), ("exit", "rank 1: the disk is full (No space left on device)")]
    assert rank0[0][0] == "barrier" and "failed on rank 0: the disk is full" in rank0[0][1]  # said before the barrier
    assert rank0[1] == ("exit", 1)


def test_an_unwritable_output_dir_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointStorageError, match="cannot be written"):
        check_writable(blocker / "out")
    with pytest.raises(CheckpointStorageError, match="cannot be written"):
        resolve_resume(blocker / "out", None)  # the Trainer's train() checks it before anything else
    check_writable(tmp_path / "fine")


def test_restarts_need_a_rendezvous_store_per_round(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        elastic.check_restart_setup()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    elastic.check_restart_setup()


def test_a_distributed_checkpoint_failure_on_any_rank_is_recognised():
    from torch.distributed.checkpoint.api import CheckpointException

    failure = CheckpointException("ranks:[0, 2]", {2: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert storage_cause(failure) == "the disk is full (No space left on device)"
    with pytest.raises(CheckpointStorageError), storage_errors("/nonexistent/run"):
        raise failure


@pytest.mark.parametrize("full", [False, True])
def test_a_short_write_is_a_storage_failure_and_a_full_disk_when_the_disk_is_full(tmp_path, monkeypatch, full):
    monkeypatch.setattr(checkpoints_module, "_disk_is_full", lambda path: full)
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    said = "the disk is full (a write came up short)" if full else "a write came up short"
    assert storage_cause(short, tmp_path) == said
    fix = "Free space" if full else "Check that disk"
    with pytest.raises(CheckpointStorageError, match=fix) as refused, storage_errors(tmp_path):
        raise short
    assert "inline_container" not in str(refused.value)  # torch's internals stay out of what the user reads


def test_every_way_a_distributed_checkpoint_fails_on_a_full_disk_says_the_disk_is_full():
    """DCP sends each rank's failure to the others pickled, without its context: on a full disk
    torch's zip writer may leave only "unexpected pos", the ENOSPC behind it lost."""
    import os
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from support.faults import small_disk

    from hf_flexdemo.integrations.checkpoints import _chain

    causes, short_writes = set(), 0
    with small_disk(1) as disk:
        if disk is None:
            pytest.skip("mounting a small tmpfs needs root and mount(8)")
        for free in range(0, 40_000, 1_000):  # every point at which the disk can run out
            for leftover in disk.iterdir():
                if leftover.is_dir():
                    shutil.rmtree(leftover)
                else:
                    leftover.unlink()
            space = os.statvfs(disk)
            (disk / "filler").write_bytes(b"x" * (space.f_bavail * space.f_frsize - free))
            try:
                dcp.save({"a": torch.randn(2000), "b": torch.randn(3000)}, checkpoint_id=disk / "checkpoint")
            except BaseException as error:  # DCP's CheckpointException is a BaseException
                sent = pickle.loads(pickle.dumps(error))  # as a peer receives it
                short_writes += any("unexpected pos" in str(e) for e in _chain(sent))
                cause = storage_cause(sent, disk)
                assert cause is not None, f"not recognised as a storage failure: {sent!r}"
                causes.add(cause.split(" (")[0])
    assert causes == {"the disk is full"}
    assert short_writes, "no failure took the short-write path: the test no longer covers it"
