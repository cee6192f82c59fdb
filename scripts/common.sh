# Helpers shared by the launchers in scripts/ (sourced, not run). Every check runs before any
# process starts and fails with exit status 2 and a message naming the variable to fix: a
# mistake found here costs seconds, the same mistake found by a rendezvous timeout costs minutes
# of every node's time.

# a worker's exit code after SIGTERM/SIGUSR1 once its checkpoint is saved: requeue the job
# (accel_common.errors.EXIT_PREEMPTED)
EXIT_PREEMPTED=75

die() {
  echo "error: $*" >&2
  exit 2
}

# require_int NAME MIN [HINT]: NAME must be set to an integer >= MIN
require_int() {
  local name=$1 min=$2 hint=${3:-}
  local value=${!name:-}
  [[ -n $value ]] || die "$name is not set${hint:+ ($hint)}"
  [[ $value =~ ^[0-9]+$ ]] || die "$name=$value: expected an integer >= $min"
  ((10#$value >= min)) || die "$name=$value: expected an integer >= $min"
}

# check_recipe: RECIPE (default pointcloud) names recipes/train_$RECIPE.py; sets RECIPE_SCRIPT
check_recipe() {
  RECIPE=${RECIPE:-pointcloud}
  RECIPE_SCRIPT=recipes/train_${RECIPE}.py
  if [[ ! -f $RECIPE_SCRIPT ]]; then
    local choices=(recipes/train_*.py)
    choices=("${choices[@]#recipes/train_}")
    die "RECIPE=$RECIPE: no file $RECIPE_SCRIPT in $PWD; choose one of: ${choices[*]%.py}"
  fi
}

# detect_gpus_per_node: GPUS_PER_NODE if given, else what SLURM granted this node, else the GPUs
# nvidia-smi lists. No silent default: a wrong count makes every node wait for processes that
# never come.
detect_gpus_per_node() {
  local n=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}}
  n=${n##*:} # SLURM_GPUS_PER_NODE may carry the GPU type, as in "a100:8"
  if [[ -z $n ]] && command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    [[ $n != 0 ]] || n=
  fi
  [[ -n $n ]] || die "GPUS_PER_NODE is not set, and neither SLURM (SLURM_GPUS_ON_NODE," \
    "SLURM_GPUS_PER_NODE) nor nvidia-smi reports a GPU; set GPUS_PER_NODE=8 or request" \
    "GPUs (sbatch --gpus-per-node=8)"
  GPUS_PER_NODE=$n
  require_int GPUS_PER_NODE 1
}

# resolve_bin VAR NAME: $VAR if set, else the project's venv (the same Python on every node of a
# shared filesystem), else NAME from PATH
resolve_bin() {
  local var=$1 name=$2
  if [[ -n ${!var:-} ]]; then
    echo "${!var}"
  elif [[ -x .venv/bin/$name ]]; then
    echo "$PWD/.venv/bin/$name"
  else
    echo "$name"
  fi
}
