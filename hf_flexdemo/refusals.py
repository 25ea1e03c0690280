"""A refusal reaches the user once, as its message: not once per process inside a traceback.

hf_flexdemo refuses bad settings by raising ``ValueError`` with a message that names the
setting, the value and what to write instead; its own exception classes (replicas that
drifted apart, a lost Lighthouse, a full disk) stop a run with a message that says what to do,
and are treated alike, their class name kept in the line.
Uncaught in a job of N processes, Python would print it N times, each inside a traceback
of some forty lines. :func:`install` (run by ``import hf_flexdemo``) wraps
``sys.excepthook`` so that such an error prints its message once, on the first process of
each launch (``LOCAL_RANK`` 0, so every machine's log says why it stopped), and the other
processes exit quietly. Under torchelastic they wait first: its agent stops every worker at
the first exit, and the one that speaks must not be stopped before it has; one that is still
running after 30 s (its first process was not refused) says the message itself. The exit
code stays 1: Python sets it after the hook.

Under torchelastic (``accelerate launch``, ``torchrun``) the process that says it also writes
the line into its error file (``TORCHELASTIC_ERROR_FILE``, torch's ``record`` format), so the
launcher's closing "Root Cause" block shows the refusal instead of "To enable traceback see
...". torch's elastic agent restarts a failed job whatever the cause (``--max_restarts N``:
no exit status or error-file field stops it), so a refusal comes back in every round; each
machine prints a given refusal once per job (a file in the temporary directory, named by
the launcher's run id and process, remembers what the rounds before said).

A hook installed after ours that prints a traceback before handing on (wandb's, at
``wandb.init``) gets ours on top again (:func:`install`, called again when the Trainer is
built and at the first step of each training run, after the reporting callbacks started); a refusal still reaches it, with its output dropped, so that wandb
marks the run failed.

Every other uncaught error keeps its traceback, and ``HF_FLEXDEMO_TRACEBACK=1`` gives the
refusals theirs back (on every process). ``torch.distributed`` wraps the hook it finds at
``init_process_group`` to prefix each line with ``[rankN]:``, which reaches ours too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

TRACEBACK_ENV = "HF_FLEXDEMO_TRACEBACK"
_PACKAGE = __name__.partition(".")[0]
_QUIET_EXIT_DELAY_S = 30.0


def is_refusal(error: BaseException) -> bool:
    """Raised by hf_flexdemo's own code, as a ``ValueError`` or one of hf_flexdemo's exception classes.

    A ``ValueError`` that torch or a script raises, even when hf_flexdemo called it, is not one.
    """
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    raised_by = str(tb.tb_frame.f_globals.get("__name__", ""))
    own_class = type(error).__module__.partition(".")[0] == _PACKAGE
    return raised_by.partition(".")[0] == _PACKAGE and (isinstance(error, ValueError) or own_class)


def _first_process_of_launch() -> bool:
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


def _wants_traceback() -> bool:
    return os.environ.get(TRACEBACK_ENV, "0").strip().lower() not in ("", "0", "false", "no")


class RefusalHook:
    """``sys.excepthook``: one line for a refusal, the previous hook for everything else."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if _HANDING_ON or _wants_traceback() or not is_refusal(error):
            self.previous(kind, error, tb)
            return
        _hand_on_quietly(self.previous, kind, error, tb)
        if _first_process_of_launch():
            _say(error, "")
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            # The launcher stops every worker when the first one exits: let the one that speaks exit first.
            time.sleep(_QUIET_EXIT_DELAY_S)
            # Still running: the first process did not stop (it was not refused), so this one speaks.
            _say(error, f" on rank {os.environ.get('RANK', '?')}")


_HANDING_ON = False


def _hand_on_quietly(previous, kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    """Let the hooks below record the failure (wandb marks its run failed) without printing anything."""
    global _HANDING_ON
    _HANDING_ON = True
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            previous(kind, error, tb)
    except Exception:  # a hook below failed: the refusal is still said
        pass
    finally:
        _HANDING_ON = False


def _line(error: BaseException, where: str) -> str:
    # A ValueError is a refused setting; hf_flexdemo's own errors (replicas drifted, Lighthouse lost) stop a run.
    verb, kind = ("refused", "") if isinstance(error, ValueError) else ("stopped", f"{type(error).__name__}: ")
    return f"hf_flexdemo {verb} this run{where}: {kind}{error}"


def _say(error: BaseException, where: str) -> None:
    line = _line(error, where)
    _record_for_launcher(line)
    if _said_in_an_earlier_round(line):
        return
    print(f"{line}\n({TRACEBACK_ENV}=1 shows the traceback.)", file=sys.stderr)
    sys.stderr.flush()


def _record_for_launcher(line: str) -> None:
    """The launcher's failure summary reads this file: its Root Cause then shows ``line``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    # torch's string form of the message is shown as it is (its dict form would show a traceback).
    message = f"{line} ({TRACEBACK_ENV}=1 shows the traceback.)"
    try:
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    except OSError:
        pass  # the summary then says what it always said


def _said_in_an_earlier_round(line: str) -> bool:
    """Whether this launch already printed ``line`` in an earlier restart round (and remember it if not)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return False
    # The launcher (the parent) lives through every round; its run id alone may repeat between jobs.
    key = hashlib.sha256(f"{run}-{os.getppid()}".encode()).hexdigest()[:16]
    record = Path(tempfile.gettempdir()) / f"hf_flexdemo-refusals-{key}.txt"
    digest = hashlib.sha256(line.encode()).hexdigest()
    try:
        said = record.read_text().split() if record.exists() else []
        if digest in said and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            return True
        with record.open("a") as file:
            file.write(digest + "\n")
    except OSError:
        pass
    return False


_INSTALLED = False


def install() -> None:
    """Wrap ``sys.excepthook`` (keeps the hook installed before): once per process, and again when a
    hook of another library has been put above ours since (wandb's prints a traceback first).

    torch.distributed's wrapper (``[rankN]:`` prefixes) hands every error on as it is: it stays on top.
    """
    global _INSTALLED
    if not _INSTALLED or _foreign_hook_on_top():  # not an isinstance test alone: torch may have wrapped ours
        sys.excepthook = RefusalHook(sys.excepthook)
        _INSTALLED = True


def _foreign_hook_on_top() -> bool:
    hook = sys.excepthook
    if isinstance(hook, RefusalHook):
        return False
    return str(getattr(hook, "__module__", "") or "").partition(".")[0] not in (_PACKAGE, "torch")
