# accel-recipes: `make train` sets everything up and trains on a built-in example;
# `make test` runs the test suite. RECIPE= picks the recipe, ARGS= passes flags through.
#   make train                                   (the point-cloud diffusion recipe, example data)
#   make train RECIPE=template ARGS="--epochs 5"
#   make train-8gpu RECIPE=template ARGS="--bs 512"
#   make train-multinode NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500
#   make train-8gpu MAX_RESTARTS=3 ARGS="--save-every 500"   (restart after a rank dies)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, from a pinned pair known to work with torchvision/timm; override for your CUDA:
#   make install TORCH_SPEC="torch torchvision --index-url https://download.pytorch.org/whl/cu126"
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
RECIPE ?= pointcloud
ARGS ?=
GPUS_PER_NODE ?= 8
NNODES ?= 2
NODE_RANK ?= 0
# the head node's address, the same on every node: train-multinode requires it (a 127.0.0.1
# default would leave the other nodes waiting for a head that is not there)
MASTER_ADDR ?=
MASTER_PORT ?= 29500
# launch targets: restarts of the worker group after a rank dies (torch elastic); the restarted
# workers continue from the newest complete checkpoint by themselves (docs/multinode.md)
MAX_RESTARTS ?= 0
STAMP := $(VENV)/.installed
# the oldest versions the project keeps (requirements/oldest.txt), in a second environment
OLDEST_VENV ?= .venv-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed
# the GPU targets write their logs and tables here; SETUP= skips the install step on a machine
# whose python already holds the packages (then name its folder: BIN=/path/to/venv/bin)
GPU_OUT ?= runs/gpu
GPU_WORKERS ?= 6
SETUP ?= install

SCRIPT = recipes/train_$(RECIPE).py
# runs the launcher so that a failure reads as one line with the worker's exit code (2, 3 or 4)
LAUNCH = $(VENV)/bin/accel-recipes launch --

# $(call launch,DEFAULT_CONFIG,EXTRA_LAUNCH_FLAGS): accelerate launch with CONFIG (or the default),
# refusing a config file that does not exist before anything starts.
define launch
	@cfg="$(or $(CONFIG),$(1))"; test -f "$$cfg" || { echo "error: CONFIG=$$cfg: no such" \
	  "accelerate config file; choose one of: $(wildcard accelerate_configs/*.yaml)" >&2; exit 2; }; \
	set -x; OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(LAUNCH) $(BIN)/accelerate launch \
	  --config_file "$$cfg" $(2) --max_restarts $(MAX_RESTARTS) $(SCRIPT) $(ARGS)
endef

.PHONY: install train train-cpu train-1gpu train-2gpu train-4gpu train-8gpu train-multinode \
        test test-oldest test-gpu bench-gpu gpu-pass lint format bench clean check-recipe

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[all]"
	touch $(STAMP)

# the same install at the oldest versions we keep (pyproject's floors): make test-oldest
$(OLDEST_STAMP): pyproject.toml requirements/oldest.txt
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install --quiet -c requirements/oldest.txt torch torchvision
	$(OLDEST_VENV)/bin/python -m pip install --quiet -c requirements/oldest.txt -e ".[all]"
	touch $(OLDEST_STAMP)

check-recipe:
	@test -f $(SCRIPT) || { echo "error: RECIPE=$(RECIPE): no file $(SCRIPT); choose one of:" \
	  $(patsubst recipes/train_%.py,%,$(wildcard recipes/train_*.py)) >&2; exit 2; }

# one process, on the GPU if there is one, else the CPU
train: install check-recipe
	$(BIN)/python $(SCRIPT) $(ARGS)

# two CPU processes over gloo: the distributed code path without a GPU
train-cpu: install check-recipe
	$(call launch,accelerate_configs/cpu_2proc.yaml)

train-1gpu train-2gpu train-4gpu train-8gpu: train-%gpu: install check-recipe
	$(call launch,accelerate_configs/$*gpu.yaml)

# run on every node, NODE_RANK=0 on the head node (MASTER_ADDR); see docs/multinode.md.
# --rdzv_backend is on the command line because accelerate ignores it in a config file.
train-multinode: install check-recipe
	@test -n "$(MASTER_ADDR)" || { echo "error: MASTER_ADDR is not set: give the head node's" \
	  "address, the same on every node (MASTER_ADDR=10.0.0.1)" >&2; exit 2; }
	$(call launch,accelerate_configs/multinode_2x8.yaml,--num_machines $(NNODES) \
	  --num_processes $$(( $(NNODES) * $(GPUS_PER_NODE) )) --machine_rank $(NODE_RANK) \
	  --main_process_ip $(MASTER_ADDR) --main_process_port $(MASTER_PORT) --rdzv_backend c10d)

# lint first (fast), then the suite on TEST_WORKERS pytest-xdist workers (0: one process), each
# test module on one worker, so a module's trained fixture runs once; one thread per worker, and
# idle OpenMP threads sleep rather than spin (two busy workers share the 2 cores of CI);
# PYTEST_ARGS="-k resume" narrows it
TEST_WORKERS ?= 2
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n $(TEST_WORKERS) \
	  --dist loadgroup --no-loadscope-reorder --durations=10 $(PYTEST_ARGS)

# the version-dependent tests (FSDP and sharded checkpoints, resume, mixed precision, convert) at
# the oldest versions we keep, in OLDEST_VENV; CI runs it after `make test`
OLDEST_TESTS ?= tests/test_sharded.py tests/test_resume.py tests/test_checkpoint.py \
  tests/test_cli.py tests/test_captioning.py tests/test_captioning_fp16_log.py tests/test_options.py
OLDEST_SELECT ?= test_sharded or test_resume or test_checkpoint or test_captioning_fp16_log \
  or convert or bf16 or fp16 or overflow
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -c 'import torch, accelerate; \
	  print("oldest: torch", torch.__version__, "accelerate", accelerate.__version__)'
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(OLDEST_VENV)/bin/python -m pytest \
	  -n $(TEST_WORKERS) --dist loadgroup --durations=5 $(OLDEST_TESTS) -k "$(OLDEST_SELECT)"

# the GPU suite (tests/gpu; skipped where CUDA is absent, so CI never runs it), one recipe per
# pytest-xdist worker on the one GPU; logs and measured tolerances go to GPU_OUT
test-gpu: $(SETUP)
	mkdir -p $(GPU_OUT)
	set -o pipefail; GPU_OUT=$(abspath $(GPU_OUT)) $(BIN)/python -m pytest tests/gpu -m gpu \
	  -n $(GPU_WORKERS) --dist loadgroup --durations=10 --junitxml=$(GPU_OUT)/gpu_suite.xml \
	  2>&1 | tee $(GPU_OUT)/gpu_suite.log

# samples/s, peak memory and TFLOP/s per recipe at the originals' sizes, fp32/bf16/fp16
bench-gpu: $(SETUP)
	mkdir -p $(GPU_OUT)
	set -o pipefail; $(BIN)/python benchmarks/bench_gpu.py --out $(GPU_OUT) \
	  --docs docs/BENCHMARKS.md 2>&1 | tee $(GPU_OUT)/gpu_bench.log

# the whole GPU pass in one command (about 10 min on one H100): the suite, then the benchmark
# even if the suite failed; the exit code is the suite's, else the benchmark's
gpu-pass: $(SETUP)
	$(MAKE) --no-print-directory test-gpu SETUP= ; suite=$$?; \
	$(MAKE) --no-print-directory bench-gpu SETUP= && exit $$suite

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# each benchmark rewrites only its own section of docs/BENCHMARKS.md
bench: install
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_overhead.py --out docs/BENCHMARKS.md
	OMP_NUM_THREADS=1 $(BIN)/accel-recipes bench --out docs/BENCHMARKS.md --plot docs/scaling.png
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_graphs.py --out docs/BENCHMARKS.md

clean:
	rm -rf runs data/example .pytest_cache
