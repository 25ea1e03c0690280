"""The fake Hub speaks enough of the Hub API for the real `huggingface_hub` client.

Each check runs the client in a subprocess with `HF_ENDPOINT` pointing at the server, which is how
Trainer tests use it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from support.fake_hub import FakeHub

pytestmark = pytest.mark.unit

TOKEN = "hf_test_secret"

# Runs in the child: `ARGS` holds the JSON passed on the command line, `emit` reports back to the test.
_PRELUDE = """
import json, sys
from pathlib import Path
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError
ARGS = json.loads(sys.argv[1])
def emit(**values):
    print(json.dumps(values))
"""


@pytest.fixture
def hub():
    with FakeHub(token=TOKEN) as server:
        yield server


def run_client(hub: FakeHub, tmp_path: Path, script: str, **args: Any) -> dict[str, Any]:
    """Run `script` in a fresh interpreter against `hub` and return what it emitted."""
    env = hub.env(with_token=False, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(script), json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert TOKEN not in proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_folder(root: Path) -> dict[str, bytes]:
    """A text file and a ~200 KB safetensors file, as the Trainer would push."""
    root.mkdir()
    (root / "notes.txt").write_text("trained on the fake hub\n")
    generator = torch.Generator().manual_seed(0)
    save_file({"weight": torch.randn(224, 224, generator=generator)}, str(root / "model.safetensors"))
    return {path.name: path.read_bytes() for path in root.iterdir()}


def test_create_repo_and_upload_folder_roundtrip(hub: FakeHub, tmp_path: Path) -> None:
    local = make_folder(tmp_path / "out")
    assert 190_000 < len(local["model.safetensors"]) < 210_000
    result = run_client(
        hub,
        tmp_path,
        """
        api = HfApi(token=ARGS["token"])
        url = api.create_repo("tiny-model", exist_ok=True)
        again = api.create_repo("tiny-model", exist_ok=True)  # a 409 that exist_ok accepts
        first = api.upload_folder(repo_id=url.repo_id, folder_path=ARGS["folder"])
        second = api.upload_folder(repo_id=url.repo_id, folder_path=ARGS["folder"])  # unchanged: no commit
        emit(endpoint=constants.ENDPOINT, repo_id=url.repo_id, same_url=str(again) == str(url),
             first=first.oid, second=second.oid, whoami=api.whoami()["name"])
        """,
        token=TOKEN,
        folder=str(tmp_path / "out"),
    )
    assert result["endpoint"] == hub.endpoint
    assert result["repo_id"] == "test-user/tiny-model" and result["same_url"]
    assert result["whoami"] == "test-user"
    assert hub.files("test-user/tiny-model") == local
    (commit,) = hub.commits("test-user/tiny-model")
    assert commit.oid == result["first"] == result["second"]
    assert sorted(commit.added) == sorted(local)


def test_wrong_token_gives_401_with_clear_message(hub: FakeHub, tmp_path: Path) -> None:
    result = run_client(
        hub,
        tmp_path,
        """
        try:
            HfApi(token="hf_wrong_token").create_repo("tiny-model", exist_ok=True)
        except HfHubHTTPError as err:
            emit(status=err.response.status_code, message=str(err))
        """,
    )
    assert result["status"] == 401
    assert "Invalid credentials in Authorization header" in result["message"]
    assert hub.repo_ids() == []
    assert TOKEN not in repr(hub) + repr(hub.requests)


def test_refused_push_raises_hub_error_with_server_text(hub: FakeHub, tmp_path: Path) -> None:
    local = make_folder(tmp_path / "out")
    hub.refuse_uploads = 403
    hub.refuse_message = "uploads are frozen for this test"
    hub.refuse_after_commits = 1  # the first push goes through, later ones are refused
    result = run_client(
        hub,
        tmp_path,
        """
        api = HfApi(token=ARGS["token"])
        repo_id = api.create_repo("tiny-model").repo_id
        api.upload_folder(repo_id=repo_id, folder_path=ARGS["folder"])
        Path(ARGS["folder"], "notes.txt").write_text("changed\\n")
        try:
            api.upload_folder(repo_id=repo_id, folder_path=ARGS["folder"])
        except HfHubHTTPError as err:
            emit(name=type(err).__name__, status=err.response.status_code, message=str(err))
        """,
        token=TOKEN,
        folder=str(tmp_path / "out"),
    )
    assert (result["name"], result["status"]) == ("HfHubHTTPError", 403)
    assert "uploads are frozen for this test" in result["message"]
    assert hub.files("test-user/tiny-model") == local  # the refused push changed nothing
    assert len(hub.commits("test-user/tiny-model")) == 1
