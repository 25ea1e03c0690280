#!/usr/bin/env bash
# Everything the GPU figures of BENCHMARKS.md need, in one run of the `device` tool (under 8 minutes on
# an H100 or H200), figures written under $OUT. The machine has torch, transformers and accelerate but lacks
# datasets, evaluate and a few small packages, and cannot download: fetch their wheels here first
# (the command is in ../shared/NOTES.md, into .whl/, kept out of git) and pass `carry: [".whl"]`.
#
#   device run: bash benchmarks/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
SITE=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
  export PYTHONPATH=$SITE
fi
pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the editable install is not always seen there

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} >"$OUT/device.txt" 2>&1

# The optimizer step: OLMo2-1B's and T5-small's shapes, bf16, against fused AdamW and the model's own
# forward and backward on the same GPU; state, peak memory and one profiled step per configuration.
timeout 240 python benchmarks/gpu_step.py --model olmo2-1b --steps 3 --repeats 5 --profile --fwd_bwd \
  >"$OUT/gpu_step_olmo2.txt" 2>&1
timeout 60 python benchmarks/gpu_step.py --model t5-small --profile --fwd_bwd --batch 32 --seq 512 \
  >"$OUT/gpu_step_t5.txt" 2>&1

# The NCCL path: the same step as one rank of an NCCL process group (one GPU: one rank).
timeout 90 torchrun --standalone --nproc-per-node 1 benchmarks/gpu_step.py --model t5-small --steps 2 --repeats 2 \
  >"$OUT/gpu_step_t5_nccl.txt" 2>&1

# End to end: the stock script on one GPU, FlexDeMo's default against adamw_torch_fused.
for optim in flexdemo adamw_torch_fused; do
  timeout 120 python training_scripts/train_olmo2.py --preset offline --bf16 --hidden_size 768 --num_layers 6 \
    --block_size 512 --max_steps 300 --logging_steps 50 --optim "$optim" --output_dir "$SITE/run_$optim" \
    >"$OUT/trainer_$optim.txt" 2>&1
done

timeout 150 python -m pytest -q -m unit -p no:cacheprovider >"$OUT/unit.txt" 2>&1
tail -n 3 "$OUT"/*.txt
