#!/usr/bin/env bash
# Several nodes without SLURM: run this on every node, changing only NODE_RANK (0 on the head).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
#     scripts/torchrun_multinode.sh --bs 1024
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \
#     scripts/torchrun_multinode.sh --bs 1024
# Environment: NNODES, NODE_RANK, MASTER_ADDR (required); MASTER_PORT (default 29500);
# GPUS_PER_NODE (default: nvidia-smi's count); RECIPE (default pointcloud); ARGS (recipe flags,
# before the arguments); RDZV_ID (default accel-recipes, the same on every node); TORCHRUN (the
# binary); ACCELERATE_MIXED_PRECISION (default bf16, as in accelerate_configs/; a recipe's
# --mixed-precision flag overrides it); MAX_RESTARTS (default 0: how often torchrun restarts the
# workers after a rank dies; they continue from the newest complete checkpoint by themselves);
# ACCEL_RECIPES (default: the venv's accel-recipes, else PATH's).
#
# torchrun runs under `accel-recipes launch`, which turns a worker's error into one line with its
# exit code, and a preemption (SIGUSR1/SIGTERM; the workers save and stop) into exit code 75: a
# bare torchrun exits 1 for both, so a scheduler could not tell "requeue me" from a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

require_int NNODES 1 "the number of nodes, e.g. NNODES=2"
require_int NODE_RANK 0 "0 on the head node, 1..NNODES-1 on the others"
((10#$NODE_RANK < 10#$NNODES)) ||
  die "NODE_RANK=$NODE_RANK: expected 0..$((NNODES - 1)) for NNODES=$NNODES"
[[ -n ${MASTER_ADDR:-} ]] || die "MASTER_ADDR is not set: the head node's address, the same" \
  "on every node (not 127.0.0.1 unless all 'nodes' are this machine)"
MASTER_PORT=${MASTER_PORT:-29500}
require_int MASTER_PORT 1
MAX_RESTARTS=${MAX_RESTARTS:-0}
require_int MAX_RESTARTS 0 "worker-group restarts after a failure"
check_recipe
detect_gpus_per_node
# plain torchrun reads no accelerate config; keep the configs' bf16 unless told otherwise
export ACCELERATE_MIXED_PRECISION=${ACCELERATE_MIXED_PRECISION:-bf16}
# torchrun's --signals-to-handle: pass SIGUSR1 (SLURM's warning) on to the workers, which save a
# checkpoint and stop; without it SIGUSR1 kills torchrun and orphans them
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

read -ra recipe_args <<<"${ARGS:-}"
cmd=(
  "$(resolve_bin TORCHRUN torchrun)"
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE"
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
  --rdzv_id "${RDZV_ID:-accel-recipes}" --max-restarts "$MAX_RESTARTS"
  "$RECIPE_SCRIPT" "${recipe_args[@]}" "$@"
)
echo "[node $NODE_RANK of $NNODES, $(hostname)] $(printf '%q ' "${cmd[@]}")"
exec "$(resolve_bin ACCEL_RECIPES accel-recipes)" launch -- "${cmd[@]}"
