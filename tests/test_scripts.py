"""The ready-made scripts on their offline presets, 2 simulated nodes x 2 processes each.

T5 pushes to a local stand-in of the Hub and logs to wandb (offline); ViT's push is refused
by that server after training; OLMo2 trains plainly. A few steps each: the loss goes down,
a checkpoint is written, the metric is computed, the model card has the figures, and the
token never shows up in what the runs print or write.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from support.accelerate_runs import launch_command
from support.fake_hub import FakeHub
from support.launch import REPO_ROOT, child_env, run_checked
from support.t5_run import STEPS as T5_STEPS
from support.t5_run import TOKEN, push_flags

from hf_flexdemo.config import DEFAULT_WIRE

pytestmark = pytest.mark.scripts

SCRIPTS = REPO_ROOT / "training_scripts"
STEPS = "--max_steps 8 --save_strategy steps --save_steps 4 --logging_steps 1 --warmup_steps 0".split()


def script_command(script: str, output_dir: Path, *flags: str, config: str = "cpu_2x2.yaml") -> list[str]:
    args = ["--preset", "offline", "--output_dir", str(output_dir), *STEPS, *flags]
    return launch_command(str(SCRIPTS / script), *args, config=config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, t5_reference):
    """T5 is the shared reference run (tests/support/t5_run.py: pushed, logged to wandb, 10 steps saved each step)."""
    root = tmp_path_factory.mktemp("scripts")
    out = {"t5": t5_reference.process, "t5_files": t5_reference.hub_files, "t5_commits": t5_reference.hub_commits}
    out["dirs"] = {"t5": t5_reference.output_dir, "wandb": t5_reference.wandb_dir}
    with FakeHub(token=TOKEN) as hub:
        env = hub.env(child_env(HF_HOME=str(root / "hf_home")), with_token=False)
        hub.refuse_uploads, hub.refuse_message = 403, "You have no write access to test-user/vit-flexdemo"
        hub.refuse_endpoints = {"commit"}
        vit = script_command("train_vit.py", root / "vit", *push_flags("test-user/vit-flexdemo"))
        # Expected to fail at the refused push: its exit status is one of the assertions.
        out["vit"] = subprocess.run(vit, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        out["vit_files"] = hub.files("test-user/vit-flexdemo")
    olmo2 = script_command("train_olmo2.py", root / "olmo2", "--max_train_samples", "400")
    out["olmo2"] = run_checked(olmo2, timeout=900, env=env)
    # Fine-tuning: the model that run saved (Hub format) trains on other text through the same script,
    # on 1 node x 2 processes (a saved model does not depend on the layout that trained it).
    tune = ["--model_name_or_path", str(root / "olmo2"), "--no_from_config", "--offline_text", "docstrings"]
    tuning = script_command("train_olmo2.py", root / "olmo2_ft", *tune, config="cpu_1x2.yaml")
    out["olmo2_ft"] = run_checked(tuning, timeout=900, env=env)
    out["dirs"].update({name: root / name for name in ("vit", "olmo2", "olmo2_ft")})
    out["root"] = root
    return out


STEPS_OF = {"t5": T5_STEPS, "vit": 8, "olmo2": 8, "olmo2_ft": 8}


def logged_losses(output_dir: Path, steps: int = 8) -> list[float]:
    state = json.loads(next(output_dir.glob(f"checkpoint-{steps}/trainer_state.json")).read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.mark.parametrize("name", ["t5", "vit", "olmo2", "olmo2_ft"])
def test_loss_goes_down_and_a_checkpoint_is_written(runs, name):
    output_dir, steps = runs["dirs"][name], STEPS_OF[name]
    losses = logged_losses(output_dir, steps)
    assert len(losses) == steps and sum(losses[-2:]) < sum(losses[:2]), losses
    for step in (steps // 2, steps):
        checkpoint = output_dir / f"checkpoint-{step}"
        assert (checkpoint / "trainer_state.json").exists()
        assert any((checkpoint / "optimizer_0").iterdir()) and any((checkpoint / "pytorch_model_fsdp_0").iterdir())


@pytest.mark.parametrize(
    "name,metrics",
    [
        ("t5", ["eval_loss", "eval_bleu", "eval_chrf"]),
        ("vit", ["eval_loss", "eval_accuracy"]),
        ("olmo2", ["eval_loss", "eval_perplexity"]),
    ],
)
def test_metrics_are_computed(runs, name, metrics):
    results = json.loads((runs["dirs"][name] / "eval_results.json").read_text())
    for key in metrics:
        assert isinstance(results[key], float), results
    assert (runs["dirs"][name] / "model.safetensors").stat().st_size > 10_000  # full weights, gathered


@pytest.mark.parametrize("name,metric", [("t5", "eval_chrf"), ("vit", "eval_accuracy"), ("olmo2", "eval_perplexity")])
def test_model_card_has_the_figures(runs, name, metric):
    card = (runs["dirs"][name] / "README.md").read_text()
    assert f"FlexDeMo(wire='{DEFAULT_WIRE}', scheme='demo', topk=128, chunk=64" in card
    assert "2 nodes x 2 processes" in card
    sent = re.search(
        rf"over {STEPS_OF[name]} steps: \*\*([\d.]+ [KMG]?B)\*\* sent, against\s+\*\*([\d.]+ [KMG]?B)\*\*", card
    )
    assert sent, card
    assert f"| {metric} |" in card and "tags:" in card and "- flexdemo" in card


def test_push_sends_checkpoints_and_the_card_intact(runs):
    files, local = runs["t5_files"], runs["dirs"]["t5"]
    for name in ("model.safetensors", "config.json", "README.md", "tokenizer.json", "tokenizer_config.json"):
        assert files[name] == (local / name).read_bytes(), name
    titles = [c.title for c in runs["t5_commits"]]
    # A save while the last push is still uploading is not pushed (the Trainer skips it): at least the first is.
    assert titles[0] == "Training in progress, step 1" and titles[-1] == "End of training", titles
    # Every pushed checkpoint is a model that loads: gathered weights, config and tokenizer.
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(runs["t5_commits"][0].added)


def test_refused_push_gives_a_clear_error_and_keeps_local_files_whole(runs):
    proc, local = runs["vit"], runs["dirs"]["vit"]
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "The Hub at" in output and "403" in output and "no write access" in output
    assert "Nothing local was lost" in output and "holds the final model and the complete checkpoint" in output
    # The checkpoint pushes during training failed too: said, not swallowed, and training went on.
    assert "Pushing a checkpoint to the Hub at" in output and "Training goes on" in output
    assert runs["vit_files"] == {}
    assert (local / "model.safetensors").exists() and (local / "README.md").exists()
    assert (local / "checkpoint-8" / "trainer_state.json").exists()


def test_wandb_offline_run_records_the_flexdemo_figures(runs):
    # wandb 0.31 has no Python reader for its run file; its history records hold the keys as text.
    records = list(runs["dirs"]["wandb"].glob("wandb/offline-run-*/run-*.wandb"))
    assert len(records) == 1, list(runs["dirs"]["wandb"].rglob("*"))[:20]
    data = records[0].read_bytes()
    for key in ("train/loss", "flexdemo/bytes_sent", "flexdemo/dense_bytes", "flexdemo/x_fewer_than_bf16_dense"):
        assert data.count(key.encode()) >= T5_STEPS, key  # one history row per logging step


def test_the_token_never_appears_in_output_or_files(runs):
    for name in ("t5", "vit", "olmo2"):
        assert TOKEN not in runs[name].stdout + runs[name].stderr, name
    for path in (*runs["root"].rglob("*"), *runs["dirs"]["t5"].parent.rglob("*")):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    for content in runs["t5_files"].values():
        assert TOKEN.encode() not in content


def test_fine_tuning_starts_from_the_saved_model_and_its_tokenizer(runs):
    base, tuned = runs["dirs"]["olmo2"], runs["dirs"]["olmo2_ft"]
    assert (tuned / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    # From the trained weights, not a fresh model: the first loss is below the base run's first loss.
    assert logged_losses(tuned)[0] < logged_losses(base)[0] - 0.3, (logged_losses(base), logged_losses(tuned))
