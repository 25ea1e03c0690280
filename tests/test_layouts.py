"""Layouts other than 2 x 2: one process per node (DeMo's one-GPU-per-node setting)."""

from __future__ import annotations

import json

import pytest
from support.accelerate_runs import COMMON, launch_command
from support.launch import REPO_ROOT, TESTS_DIR, free_port, start_logged, stopped_at_exit, torchrun

pytestmark = pytest.mark.multiprocess


def test_two_nodes_with_one_process_each_train_flexdemo_in_step(tmp_path):
    worker = str(TESTS_DIR / "workers" / "trainer_worker.py")
    port, launchers, logs = str(free_port()), [], []
    for machine in (0, 1):
        node = ["--machine_rank", str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port", port]
        args = [worker, "--runs", "t5:flexdemo", "--processes_per_node", "1", "--output_dir", str(tmp_path), *COMMON]
        command = launch_command(*node, *args, config="cpu_2machines_1each.yaml")
        logs.append(tmp_path.parent / f"{tmp_path.name}-machine{machine}.log")
        launchers.append(start_logged(command, logs[-1]))
    with stopped_at_exit(*launchers):
        codes = [launcher.wait(timeout=600) for launcher in launchers]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    results = [json.loads((tmp_path / "t5_flexdemo" / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert len(set(result["replica_fingerprints"])) == 1  # the two nodes hold the same parameters
        # No reduction across nodes but the replicas' one 8-byte agreement on ns_dtype='auto'.
        assert result["flexdemo_exchanges"] == 8 and result["inter_node_reduction_bytes"] == 8
        assert result["flexdemo_wire_bytes"] == result["flexdemo_counted_bytes"] > 0


def test_the_plain_fsdp2_quickstart_trains_without_hugging_face(tmp_path):
    """`shard_within_node` + FlexDeMo with torchrun alone, 2 nodes x 2 processes."""
    script = REPO_ROOT / "training_scripts" / "quickstart_fsdp2.py"
    proc = torchrun(script, 4, "--steps", "6")
    assert "6 steps in" in proc.stdout and "on 2 nodes x 2 processes" in proc.stdout, proc.stdout
    assert "with FlexDeMo" in proc.stdout and "fewer)" in proc.stdout
