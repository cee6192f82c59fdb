#!/usr/bin/env bash
# The batch-step half of train_1node.sbatch and train_multinode.sbatch: works out the head node,
# GPUs per node and a port once, then starts scripts/slurm/node.sh on every node with srun (one
# task per node), each node logging to its own file. Arguments are passed to the recipe.
#
# Environment: RECIPE (default pointcloud), ARGS (recipe flags), GPUS_PER_NODE (default: from
# SLURM or nvidia-smi), MASTER_ADDR (default: first host of the allocation), MASTER_PORT
# (default: from the job id), LOG_DIR (default runs/slurm), MAX_RESTARTS (default 0: restarts of
# the worker group after a rank dies), CONFIG, LAUNCH_ARGS, ACCELERATE, ACCEL_RECIPES.
#
# Preemption: the sbatch files ask for SIGUSR1 120 s before the time limit; the workers save a
# checkpoint and exit 75, and this script requeues the job (scontrol requeue), which resumes from
# that checkpoint by itself (SLURM_RESTART_COUNT tells the recipe it is a requeue).
set -euo pipefail
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
[[ -f $REPO_DIR/scripts/common.sh ]] || {
  echo "error: REPO_DIR=$REPO_DIR is not an accel-recipes checkout: submit from the repository" \
    "root (or set REPO_DIR)" >&2
  exit 2
}
cd "$REPO_DIR"
# shellcheck source=scripts/common.sh
source scripts/common.sh

[[ -n ${SLURM_JOB_NODELIST:-} ]] || die "SLURM_JOB_NODELIST is not set: submit with sbatch" \
  "(or run inside salloc); without SLURM use scripts/torchrun_multinode.sh"
require_int SLURM_JOB_ID 0 "set by sbatch"
check_recipe
detect_gpus_per_node

mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
((${#hosts[@]} > 0)) || die "scontrol show hostnames $SLURM_JOB_NODELIST listed no host"
NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-${#hosts[@]}}}
require_int NNODES 1
((NNODES == ${#hosts[@]})) ||
  die "SLURM_NNODES=$NNODES but SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST lists ${#hosts[@]} hosts"
# the rendezvous runs on the first host; every node must reach it under this name
MASTER_ADDR=${MASTER_ADDR:-${hosts[0]}}
# a port derived from the job id, below Linux's ephemeral range (32768+), so that two jobs
# sharing a node rarely collide; MASTER_PORT overrides it
MASTER_PORT=${MASTER_PORT:-$((10000 + 10#$SLURM_JOB_ID % 20000))}
require_int MASTER_PORT 1
LOG_DIR=${LOG_DIR:-runs/slurm}
MAX_RESTARTS=${MAX_RESTARTS:-0}
require_int MAX_RESTARTS 0 "worker-group restarts after a failure"
mkdir -p "$LOG_DIR"
# a node whose workers saved a checkpoint on preemption leaves this file (on the shared filesystem)
PREEMPT_MARKER=$LOG_DIR/.preempted-$SLURM_JOB_ID
rm -f "$PREEMPT_MARKER"
export REPO_DIR NNODES GPUS_PER_NODE MASTER_ADDR MASTER_PORT RECIPE MAX_RESTARTS PREEMPT_MARKER

echo "job $SLURM_JOB_ID: $NNODES node(s) x $GPUS_PER_NODE GPU(s) = $((NNODES * GPUS_PER_NODE))" \
  "processes; rendezvous $MASTER_ADDR:$MASTER_PORT; $RECIPE_SCRIPT ${ARGS:-} $*"
echo "per-node logs: $LOG_DIR/${SLURM_JOB_NAME:-JOBNAME}-$SLURM_JOB_ID-<host>.out"

srun_args=(
  --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1
  # one failing node ends the step instead of leaving the others waiting in a collective
  --kill-on-bad-exit=1
  --export=ALL
  --output="$LOG_DIR/%x-%j-%N.out"
  --open-mode=append # a requeued job keeps the earlier attempts' logs
)
# since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task
[[ -z ${SLURM_CPUS_PER_TASK:-} ]] || srun_args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
code=0
srun "${srun_args[@]}" bash scripts/slurm/node.sh "$@" || code=$?
if ((code == EXIT_PREEMPTED)) || [[ -e $PREEMPT_MARKER ]]; then
  rm -f "$PREEMPT_MARKER"
  echo "job $SLURM_JOB_ID: preempted, checkpoint saved; requeueing (it resumes by itself)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$code"
