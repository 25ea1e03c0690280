"""The stock transformers.Trainer with optim="flexdemo" on 2 simulated nodes x 2 processes.

`accelerate launch --config_file tests/configs/cpu_2x2.yaml` starts the processes, as a
user would; one start-up trains four runs in turn (T5 and OLMo2, FlexDeMo and the
AdamW-HSDP baseline), then resumes the T5 FlexDeMo run from its step-4 checkpoint, and last
resumes it with another rule, which is refused (so the launch ends in that refusal).
"""

from __future__ import annotations

import subprocess

import pytest
from support.accelerate_runs import COMMON, TRAINER_WORKER, launch_command, losses, read_run
from support.launch import child_env

pytestmark = pytest.mark.multiprocess

RUNS = ("t5_flexdemo", "t5_adamw_torch", "olmo2_flexdemo", "olmo2_adamw_torch")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    runs = "t5:flexdemo,t5:adamw_torch,olmo2:flexdemo,olmo2:adamw_torch"
    # The same checkpoint (the default rule) resumed with DeMo's sign rule last: refused before torch's loader runs.
    resumes = ["--then_resume", "t5_flexdemo/checkpoint-4", "--then_resume_with", "topk=8,chunk=16,update=sign"]
    cmd = launch_command(TRAINER_WORKER, "--runs", runs, *resumes, "--output_dir", str(out), *COMMON)
    # Warnings shown: no rank may warn about slicing a flattened mesh dimension under HSDP (the AdamW runs).
    try:
        proc = subprocess.run(
            cmd, env=child_env(PYTHONWARNINGS="default"), capture_output=True, text=True, timeout=1200
        )
    except subprocess.TimeoutExpired as late:
        said = (late.stdout or b"").decode(errors="replace") + (late.stderr or b"").decode(errors="replace")
        raise AssertionError(f"the launch outlived 1200 s:\n{said[-6000:]}") from None
    try:
        results = {name: read_run(out, name) for name in (*RUNS, "resumed")}
    except FileNotFoundError as missing:
        raise AssertionError(f"{missing}\n{(proc.stdout + proc.stderr)[-6000:]}") from None
    results["launch"] = proc
    return results


@pytest.mark.parametrize("run", ["t5_flexdemo", "olmo2_flexdemo"])
def test_loss_goes_down(launched, run):
    values = [loss for _, loss in losses(launched[run][0])]
    assert len(values) == 8
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3, values


@pytest.mark.parametrize("run", RUNS)
def test_replicas_hold_identical_parameters(launched, run):
    for rank in launched[run]:
        assert len(set(rank["replica_fingerprints"])) == 1, rank["replica_fingerprints"]


@pytest.mark.parametrize("model", ["t5", "olmo2"])
def test_no_dense_gradient_bytes_cross_nodes_under_flexdemo(launched, model):
    for rank in launched[f"{model}_flexdemo"]:
        # Nothing but the replicas' one agreement on Newton-Schulz's dtype (ns_dtype='auto'): an 8-byte flag.
        assert rank["inter_node_reduction_bytes"] == 8
        # One packed exchange per optimizer step (gradient accumulation: 2 micro-batches each).
        assert rank["flexdemo_exchanges"] == 8
        assert rank["flexdemo_wire_bytes"] == rank["flexdemo_counted_bytes"] > 0


@pytest.mark.parametrize("model", ["t5", "olmo2"])
def test_adamw_with_the_same_config_is_ordinary_hsdp(launched, model):
    for rank in launched[f"{model}_adamw_torch"]:
        assert rank["flexdemo_exchanges"] == 0
        # HSDP all-reduces every gradient shard across nodes on each optimizer step.
        assert rank["inter_node_reduction_bytes"] >= 8 * rank["grad_bytes_local"]


def test_flexdemo_figures_reach_the_trainer_logs(launched):
    for rank in launched["t5_flexdemo"]:
        logged = [h for h in rank["log_history"] if "loss" in h]
        assert all("flexdemo/bytes_sent" in h and "flexdemo/x_fewer_than_bf16_dense" in h for h in logged)
        sent = [h["flexdemo/bytes_sent"] for h in logged]
        assert sent == sorted(sent) and sent[0] > 0
        assert logged[-1]["flexdemo/dense_bytes"] > 10 * logged[-1]["flexdemo/bytes_sent"]
        # Node totals: the two processes of node 0 together.
        assert logged[-1]["flexdemo/bytes_sent_per_step"] * 8 == pytest.approx(sent[-1])


def test_resume_continues_the_same_loss_curve(launched):
    full = losses(launched["t5_flexdemo"][0])
    resumed = losses(launched["resumed"][0])
    assert [s for s, _ in resumed] == list(range(1, 9))
    assert resumed[4:] == full[4:]  # steps 5..8 were trained after the resume
    for a, b in zip(launched["t5_flexdemo"], launched["resumed"]):
        assert a["replica_fingerprints"] == b["replica_fingerprints"]
        assert a["flexdemo_counted_bytes"] == b["flexdemo_counted_bytes"]


def test_resuming_a_sharded_checkpoint_with_another_rule_is_refused_with_what_to_write(launched):
    proc = launched["launch"]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    said = out.partition("Root Cause (first observed failure):")[0]  # the launcher's summary repeats it there
    assert said.count("was trained with the adam rule") == 1, out[-3000:]  # said once, by the first process
    assert "Resume with update=adam, or update=orthogonal (the default: drop update)" in out
    assert "Missing key" not in out and "CheckpointException" not in out


def test_t5_loss_is_not_scaled_by_processes_or_accumulation(launched):
    # FlexDeMo's T5 only: an AdamW run is stock transformers' (the scripts mark their AdamW-HSDP baseline themselves).
    first_loss = losses(launched["t5_flexdemo"][0])[0][1]
    # ln(512) = 6.2 for an untrained model; x4 processes or x2 accumulation would show.
    assert 5.0 < first_loss < 8.0


def test_model_card_names_flexdemo_and_its_settings(launched):
    line = launched["t5_flexdemo"][0]["model_card_optimizer"]
    assert line.startswith("FlexDeMo(scheme='demo', topk=8, chunk=16") and "2 nodes x 2 processes" in line
    assert "update='orthogonal'" in line  # the default rule, resolved
    assert "adamw" not in line.lower()


def test_no_rank_warns_about_slicing_a_flattened_mesh_dimension_under_hsdp(launched):
    # Accelerate's HSDP lookup (optimizers other than FlexDeMo) is silenced; the AdamW-HSDP runs would show it.
    proc = launched["launch"]
    assert "Slicing a flattened dim" not in proc.stdout + proc.stderr
