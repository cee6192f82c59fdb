#!/usr/bin/env bash
# One node's part of a SLURM job: scripts/slurm/launch.sh starts this on every node with srun, one
# task per node. Every node runs the same `accelerate launch` line except --machine_rank, which
# comes from the node's place in the allocation (SLURM_NODEID; SLURM_PROCID must agree).
#
# Environment (set by launch.sh): NNODES, GPUS_PER_NODE, MASTER_ADDR, MASTER_PORT, RECIPE, ARGS,
# MAX_RESTARTS, PREEMPT_MARKER; optional CONFIG, LAUNCH_ARGS (extra `accelerate launch` flags),
# ACCELERATE and ACCEL_RECIPES (the binaries). Arguments are appended to the recipe's flags.
#
# The launch runs under `accel-recipes launch`, which passes SIGUSR1/SIGTERM on to the workers and
# exits 75 once they have saved a checkpoint on preemption; this node, which outlives the signal,
# then exits 75 too and leaves PREEMPT_MARKER for launch.sh, which requeues the job (srun may
# report another code for a node it stopped).
set -euo pipefail
cd "${REPO_DIR:-$PWD}"
# shellcheck source=scripts/common.sh
source scripts/common.sh

require_int NNODES 1 "the number of nodes; scripts/slurm/launch.sh sets it"
require_int GPUS_PER_NODE 1 "GPUs on each node; scripts/slurm/launch.sh sets it"
[[ -n ${MASTER_ADDR:-} ]] || die "MASTER_ADDR is not set (the head node's address)"
require_int MASTER_PORT 1 "the rendezvous port on the head node"
MAX_RESTARTS=${MAX_RESTARTS:-0}
require_int MAX_RESTARTS 0 "worker-group restarts after a failure"
check_recipe

rank=${SLURM_NODEID:-${SLURM_PROCID:-}}
[[ -n $rank ]] || die "SLURM_NODEID is not set: start this under srun, one task per node"
# two tasks on one node would start two launchers that both claim that node's GPUs
if [[ -n ${SLURM_PROCID:-} && $SLURM_PROCID != "$rank" ]]; then
  die "SLURM_PROCID=$SLURM_PROCID differs from SLURM_NODEID=$rank: srun must start exactly" \
    "one task per node (--ntasks-per-node=1)"
fi
((rank < NNODES)) || die "SLURM_NODEID=$rank: expected 0..$((NNODES - 1)) for NNODES=$NNODES"
# num_processes is NNODES x GPUS_PER_NODE on every node; a node with fewer GPUs would hang the rest
if [[ -n ${SLURM_GPUS_ON_NODE:-} && $SLURM_GPUS_ON_NODE != "$GPUS_PER_NODE" ]]; then
  die "node $(hostname) has SLURM_GPUS_ON_NODE=$SLURM_GPUS_ON_NODE but the job plans" \
    "GPUS_PER_NODE=$GPUS_PER_NODE: request the same GPUs on every node (--gpus-per-node)"
fi

if ((NNODES > 1)); then
  config=${CONFIG:-accelerate_configs/multinode_2x8.yaml}
  # c10d: nodes may join in any order. It must be on the command line: accelerate 1.x ignores
  # rdzv_backend from a config file (its CLI default "static" wins).
  rdzv=c10d
elif ((GPUS_PER_NODE > 1)); then
  config=${CONFIG:-accelerate_configs/8gpu.yaml}
  # static on one node: c10d without an endpoint would use the fixed port 29400 on localhost,
  # shared with any other job on the same node
  rdzv=static
else
  config=${CONFIG:-accelerate_configs/1gpu.yaml}
  rdzv=static
fi
[[ -f $config ]] || die "CONFIG=$config: no such accelerate config file"

read -ra launch_args <<<"${LAUNCH_ARGS:-}"
read -ra recipe_args <<<"${ARGS:-}"
cmd=(
  "$(resolve_bin ACCELERATE accelerate)" launch --config_file "$config"
  --num_machines "$NNODES" --num_processes "$((NNODES * GPUS_PER_NODE))"
  --machine_rank "$rank" --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT"
  --rdzv_backend "$rdzv" --max_restarts "$MAX_RESTARTS" "${launch_args[@]}"
  "$RECIPE_SCRIPT" "${recipe_args[@]}" "$@"
)
echo "[node $rank of $NNODES, $(hostname)] $(printf '%q ' "${cmd[@]}")"
# SLURM sends --signal=USR1@120 (and `scancel -s TERM`) to every process of the step, this shell
# included, whose default is to die of it: then srun reports the signal instead of the launch's
# 75 and nothing requeues the job. A trap that runs a command (an empty one would be inherited
# as "ignore" by the launch) keeps this shell waiting; the launch got the signal itself.
trap ':' TERM USR1
code=0
"$(resolve_bin ACCEL_RECIPES accel-recipes)" launch -- "${cmd[@]}" || code=$?
if ((code == EXIT_PREEMPTED)) && [[ -n ${PREEMPT_MARKER:-} ]]; then
  touch "$PREEMPT_MARKER"
fi
exit "$code"
