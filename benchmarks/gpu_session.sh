#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, in one run of the `device` tool, written under $OUT. The machine has torch,
# transformers and accelerate but lacks datasets, evaluate and a few small packages, and cannot download: fetch
# their wheels here first (the command is in ../shared/NOTES.md, into .whl/, kept out of git; add torchft 0.2.0 and
# its opentelemetry, googleapis-common-protos and protobuf wheels for the `ft` section) and pass `carry: [".whl"]`.
#
#   device run: bash benchmarks/gpu_session.sh                       # every section (over 8 minutes)
#   device run: bash benchmarks/gpu_session.sh kernels step node trainer   # the sections named, in that order
#
# Sections: kernels (the fused kernels' tests, compiled on the GPU), step and step_t5 (OLMo2-1B's, T5's shapes),
# node (one rank of a node of 8), nccl, trainer (the stock script against adamw_torch_fused), ft (a torchft node), unit,
# scale (the quality study at about 125M parameters, simulated replicas; not in the default list: it takes a whole
# call, `bash benchmarks/gpu_session.sh scale`).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
SITE=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
  export PYTHONPATH=$SITE
fi
pip install -q --no-index --no-deps --no-build-isolation -e . >"$SITE/install.log" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the editable install is not always seen there

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl',
  torch.cuda.nccl.version(), 'triton', triton.__version__)"
} >"$OUT/device.txt" 2>&1

# The fused kernels against the torch path, compiled for this GPU (the same tests CI runs under the interpreter).
section_kernels() {
  FLEXDEMO_KERNEL_TEST_DEVICE=cuda timeout 200 python -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py \
    >"$OUT/kernels.txt" 2>&1
}

# The optimizer step: OLMo2-1B's and T5-small's shapes, bf16, against fused AdamW and the model's own forward and
# backward on the same GPU; state, peak memory and one profiled step per configuration, torch and Triton kernels.
section_step() {
  timeout 240 python benchmarks/step/gpu_step.py --model olmo2-1b --steps 3 --repeats 5 --profile --fwd_bwd \
    >"$OUT/gpu_step_olmo2.txt" 2>&1
}

section_step_t5() {
  timeout 60 python benchmarks/step/gpu_step.py --model t5-small --profile --fwd_bwd --batch 32 --seq 512 \
    >"$OUT/gpu_step_t5.txt" 2>&1
}

# One rank of a node of 8 on this GPU: FSDP2's shards, the Newton-Schulz of the matrices this rank owns, the forward
# and backward (the in-node all-to-alls are not timed; their bytes are printed).
section_node() {
  timeout 120 python benchmarks/step/gpu_step.py --model olmo2-1b --node_of 8 --fwd_bwd --steps 3 --repeats 5 \
    >"$OUT/gpu_step_olmo2_node_of_8.txt" 2>&1
}

# The NCCL path: the same step as one rank of an NCCL process group (one GPU: one rank).
section_nccl() {
  timeout 90 torchrun --standalone --nproc-per-node 1 benchmarks/step/gpu_step.py --model t5-small --steps 2 --repeats 2 \
    >"$OUT/gpu_step_t5_nccl.txt" 2>&1
}

# End to end: the stock script on one GPU, FlexDeMo's default (torch and Triton kernels) against adamw_torch_fused.
section_trainer() {
  local common=(--preset offline --bf16 --hidden_size 768 --num_layers 6 --block_size 512 --max_steps 300
    --logging_steps 50)
  timeout 120 python training_scripts/train_olmo2.py "${common[@]}" --optim adamw_torch_fused \
    --output_dir "$SITE/run_adamw" >"$OUT/trainer_adamw_torch_fused.txt" 2>&1
  timeout 120 python training_scripts/train_olmo2.py "${common[@]}" --optim flexdemo \
    --output_dir "$SITE/run_flexdemo" >"$OUT/trainer_flexdemo.txt" 2>&1
  timeout 120 python training_scripts/train_olmo2.py "${common[@]}" --optim flexdemo --optim_args kernels=triton \
    --output_dir "$SITE/run_triton" >"$OUT/trainer_flexdemo_triton.txt" 2>&1
}

# The fault-tolerant path on CUDA (torchft's NCCL process group, bf16), as docs/fault-tolerance.md's launch starts a
# node: the Lighthouse, then one node of flexdemo_ft_node.yaml on this one GPU. One GPU is one node (NCCL refuses two
# ranks on one device), so the quorum is this node alone; the exit code and the absence of "terminate called" say
# that it trained, committed and freed torchft's group at exit.
section_ft() {
  if ! python -c "import torchft" 2>/dev/null; then
    echo "torchft is not installed: put its wheel in .whl/ (docs/fault-tolerance.md)" >"$OUT/ft_node.txt"
    return
  fi
  # torchft_lighthouse's entry point, run by this python (the console script pip --target writes names another
  # one); the entry point reads the arguments after the script's path, so not `python -c`.
  printf 'import sys\nfrom torchft._torchft import lighthouse_main\nsys.exit(lighthouse_main())\n' >"$SITE/lighthouse.py"
  python "$SITE/lighthouse.py" --min_replicas 1 --bind 127.0.0.1:29510 --heartbeat_timeout_ms 2000 \
    --join_timeout_ms 2000 >"$OUT/ft_lighthouse.txt" 2>&1 &
  local lighthouse=$!
  TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=1 timeout 150 \
    python -m accelerate.commands.launch --config_file accelerate_configs/flexdemo_ft_node.yaml --num_processes 1 \
    training_scripts/train_olmo2.py --preset offline --bf16 --max_steps 40 --logging_steps 10 \
    --save_strategy steps --save_steps 20 --output_dir "$SITE/run_ft" \
    --optim_args "topk=32,chunk=64,fault_tolerance=torchft" >"$OUT/ft_node.txt" 2>&1
  echo "exit code $?; terminate called: $(grep -c 'terminate called' "$OUT/ft_node.txt")" >>"$OUT/ft_node.txt"
  kill "$lighthouse"
}

# The loss at about 125M parameters (issue 44): AdamW-HSDP, the default and the wire presets 2bit and top128_4bit,
# 2 replicas simulated in one process, 1,000 steps, each side's rate swept on seed 0, then seed 1 at the winner.
# The study is resumable: carry benchmarks/results/quality/quality_olmo2_125m (its runs.json) and finished runs are not
# repeated. --time_budget starts no run after 4 minutes (a run is estimated at 1 to 2 minutes there, not yet
# measured), so that one call ends within the device tool's 10 minutes. A dry run of every configuration on a tiny
# model comes first and stops the section if the pipeline is broken.
section_scale() {
  local study=benchmarks/results/quality/quality_olmo2_125m
  timeout 180 python benchmarks/quality/quality_study.py --model olmo2_125m --dry_run >"$OUT/scale_dry_run.txt" 2>&1 || return
  timeout 500 python benchmarks/quality/quality_study.py --model olmo2_125m --steps 1000 --seeds 0 1 --time_budget 240 \
    --out "$study" >"$OUT/scale.txt" 2>&1
  mkdir -p "$OUT/quality_olmo2_125m" && cp "$study"/runs.json "$study"/table.md "$study"/*.png "$OUT/quality_olmo2_125m/"
}

# The unit tier on CUDA.
section_unit() {
  timeout 150 python -m pytest -q -m unit -p no:cacheprovider >"$OUT/unit.txt" 2>&1
}

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(kernels step step_t5 node nccl trainer ft unit)
for name in "${sections[@]}"; do
  start=$SECONDS
  "section_$name"
  echo "section $name: $((SECONDS - start)) s" >>"$OUT/sections.txt"
done
tail -n 4 "$OUT"/*.txt
# The device tool brings back at most 8 files: all of them in one archive, beside the short ones.
tar -C "$OUT" -czf "$SITE/session.tar.gz" . && mv "$SITE/session.tar.gz" "$OUT/"
find "$OUT" -name '*.txt' ! -name device.txt ! -name sections.txt -delete
