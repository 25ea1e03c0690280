#!/bin/bash
# FlexDeMo on N machines without a scheduler: run this on every machine, with the same
# MASTER_ADDR (machine 0's address) and NODE_RANK = 0..N-1.
#
#   MASTER_ADDR=10.0.0.1 NODE_RANK=0 NUM_NODES=2 GPUS_PER_NODE=8 \
#       training_scripts/launch/multinode.sh training_scripts/train_olmo2.py --bf16
#
# The AdamW-HSDP baseline with the same layout: add --optim adamw_torch.
#
# MAX_RESTARTS=N restarts every node's workers up to N times after a failure; they resume
# from the newest complete checkpoint (c10d rendezvous, one store per round: see docs/crash-safety.md).
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of machine 0}"
: "${NODE_RANK:?set NODE_RANK (0 on machine 0)}"
NUM_NODES=${NUM_NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RESTART_FLAGS=()
if [[ -n "${MAX_RESTARTS:-}" ]]; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  RESTART_FLAGS=(--rdzv_backend c10d --max_restarts "$MAX_RESTARTS")
fi

exec accelerate launch \
  --config_file accelerate_configs/flexdemo.yaml \
  --num_machines "$NUM_NODES" \
  --num_processes "$((NUM_NODES * GPUS_PER_NODE))" \
  --machine_rank "$NODE_RANK" \
  --main_process_ip "$MASTER_ADDR" \
  --main_process_port "${MASTER_PORT:-29500}" \
  --parallelism_config_dp_replicate_size "$NUM_NODES" \
  --parallelism_config_dp_shard_size "$GPUS_PER_NODE" \
  ${RESTART_FLAGS[@]+"${RESTART_FLAGS[@]}"} \
  "$@"
