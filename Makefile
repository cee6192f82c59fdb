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
# a machine without registry access: WHEELS=DIR (made by `make wheelhouse`) unpacks DIR's wheels
# into GPU_SITE, ahead of the machine's own Python (PYTHON) on PYTHONPATH; no project install
WHEELS ?=
GPU_SITE ?= .gpu-site
# `make wheelhouse`: where the wheels go, and the GPU machine's Python version
DIR ?= .whl
PY ?= 3.12
# each part of the GPU pass stops after this many seconds (9 minutes in all on one H100, with
# BENCH_TIMEOUT 210 s: the steps the targets read first, the rest as the time allows; `make
# bench-gpu` alone measures everything within 570 s)
SUITE_TIMEOUT ?= 270
KERNELS_TIMEOUT ?= 60
# pcdiff's pcdiff/ folder, for the comparison with its CUDA kernels (docs/gpu.md)
PCDIFF_SRC ?=
# the other originals' source, for the runs of their own trainers (`make bench` on the CPU:
# cricketmodel's and ComFormer's, from .originals/ when not given; Crowd-BT's: no adapter)
COMFORMER_SRC ?=
CROWDBT_SRC ?=
CRICKET_SRC ?=
# `make bench-gpu`'s end-to-end part (the originals' trainers against the recipes' presets: a
# recipe's process at most a third of it, an original's half, its CUDA kernel build and default
# torch.compile among its warm-up) and where its data and runs go
TRAINERS_TIMEOUT ?= 360
TRAINERS_WORK ?= runs/trainers
# `make gpu-pass` stops before anything on a machine whose nvidia-smi lists no GPU; 0 skips that
# check (the CPU tests of the pass's own machinery)
REQUIRE_GPU ?= 1

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
        test test-oldest test-gpu bench-gpu gpu-pass require-gpu wheels wheelhouse lint format bench \
        clean check-recipe

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

# the version-dependent tests (FSDP and sharded checkpoints, resume, mixed precision, convert, the
# speed switches: torch's fused CPU kernels and precision switches) at the oldest versions we
# keep, in OLDEST_VENV; CI runs it after `make test`
OLDEST_TESTS ?= tests/hardware/test_sharded.py tests/training/test_resume.py tests/checkpoints/test_checkpoint.py \
  tests/checkpoints/test_checkpoint_safety.py tests/checkpoints/test_tied.py \
  tests/tools/test_cli.py tests/recipes/captioning tests/recipe_cli/test_options.py tests/hardware/test_compile.py \
  tests/recipes/pointcloud/test_triton_search.py tests/recipes/pointcloud/test_triton_scatter.py \
  tests/hardware/test_speed.py
OLDEST_SELECT ?= test_sharded or test_resume or test_checkpoint or test_fp16_log \
  or convert or bf16 or fp16 or overflow or compile or triton or tied or test_speed
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -c 'import torch, accelerate; \
	  print("oldest: torch", torch.__version__, "accelerate", accelerate.__version__)'
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(OLDEST_VENV)/bin/python -m pytest \
	  -n $(TEST_WORKERS) --dist loadgroup --durations=5 $(OLDEST_TESTS) -k "$(OLDEST_SELECT)"

# wheels of what a GPU machine without registry access may lack (requirements/gpu-pass.txt), for
# its Python (PY=3.12) on x86-64 Linux; carry DIR there and run `make gpu-pass WHEELS=DIR`
wheelhouse:
	@test -n "$(DIR)" || { echo "error: DIR is empty; give the folder for the wheels, e.g." \
	  "DIR=.whl" >&2; exit 2; }; dir="$(DIR)"; while [ ! -e "$$dir" ]; do dir=$$(dirname "$$dir"); \
	  done; test -d "$$dir" || { echo "error: DIR=$(DIR): $$dir is a file, not a folder; give a" \
	  "folder for the wheels (nothing was downloaded)" >&2; exit 2; }; \
	  probe=$$(mktemp -p "$$dir" 2>/dev/null) && rm -f "$$probe" || { echo "error: DIR=$(DIR):" \
	  "cannot write in $$dir; choose a writable folder (nothing was downloaded)" >&2; exit 2; }
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(PY) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform any -d $(DIR) -r requirements/gpu-pass.txt
	@echo "$(DIR): $$(ls $(DIR)/*.whl | wc -l) wheels, $$(du -sh $(DIR) | cut -f1)"

# unpacks WHEELS into GPU_SITE for the machine's own Python, from nothing but that folder
wheels:
	@compgen -G "$(WHEELS)/*.whl" >/dev/null || { echo "error: WHEELS=$(WHEELS): no .whl files" \
	  "there; make them where PyPI is reachable: make wheelhouse DIR=$(WHEELS)" >&2; exit 2; }
	rm -rf $(GPU_SITE)
	$(PYTHON) -m pip install --quiet --no-index --no-deps --target $(GPU_SITE) $(WHEELS)/*.whl

# the GPU targets' Python (after `env`): .venv's (SETUP=install), the machine's own with WHEELS=DIR
ifneq ($(WHEELS),)
GPU_SETUP := wheels
GPU_PYTHON := PYTHONPATH=$(abspath $(GPU_SITE)):$(CURDIR) $(PYTHON)
else
GPU_SETUP := $(SETUP)
GPU_PYTHON := $(BIN)/python
endif
GPU_ENV := GPU_OUT=$(abspath $(GPU_OUT))
KERNELS := tests/gpu/test_pointcloud_kernels_on_gpu.py
# the three parts, each writing only its own files to GPU_OUT (tests/gpu's `record` fixture
# appends to gpu_suite.jsonl): suite, the pcdiff kernel comparison, the benchmark
GPU_SUITE = env $(GPU_ENV) $(GPU_PYTHON) -m pytest tests/gpu -m gpu --ignore=$(KERNELS) \
  -n $(GPU_WORKERS) --dist loadgroup --durations=10 --junitxml=$(GPU_OUT)/gpu_suite.xml
GPU_KERNELS = env $(GPU_ENV) PCDIFF_SRC=$(PCDIFF_SRC) $(GPU_PYTHON) -m pytest $(KERNELS) -m gpu \
  -n 0 --junitxml=$(GPU_OUT)/gpu_kernels.xml
# the benchmark starts nothing that would end within 15 s of its timeout (--budget)
GPU_BENCH = env PCDIFF_SRC=$(PCDIFF_SRC) $(GPU_PYTHON) benchmarks/bench_gpu.py --out $(GPU_OUT) \
  --docs docs/BENCHMARKS.md --budget $(shell expr $(BENCH_TIMEOUT) - 15) $(BENCH_ARGS)

# each original's trainer and the recipe's, end to end, as processes (bench_trainers.py)
GPU_TRAINERS = env PCDIFF_SRC=$(PCDIFF_SRC) COMFORMER_SRC=$(COMFORMER_SRC) \
  CROWDBT_SRC=$(CROWDBT_SRC) CRICKET_SRC=$(CRICKET_SRC) $(GPU_PYTHON) benchmarks/bench_trainers.py \
  --out $(GPU_OUT) --work $(TRAINERS_WORK) --docs docs/BENCHMARKS.md \
  --timeout $(shell expr $(TRAINERS_TIMEOUT) / 3) \
  --original-timeout $(shell expr $(TRAINERS_TIMEOUT) / 2) $(TRAINERS_ARGS)

# $(call ran_tests,JUNIT_XML): true when pytest's report holds a test that ran (not skipped)
ran_tests = $(PYTHON) -c 'import sys, xml.etree.ElementTree as T; r = T.parse(sys.argv[1]).getroot(); \
	s = r if r.tag == "testsuite" else r.find("testsuite"); \
	sys.exit(int(s.get("tests", 0)) - int(s.get("skipped", 0)) <= 0)' $(1) 2>/dev/null

# $(call gpu_part,NAME,SECONDS,COMMAND[,JUNIT_XML]): COMMAND stopped after SECONDS; one line says
# how it ended, and a part that failed, timed out or (by its JUnit report) ran no test is added to
# $failed (the next part still runs)
define gpu_part
echo "== $(1) (at most $(2) s)"; timeout -k 5 $(2) $(3); rc=$$?; \
	if [ $$rc = 0 ] && [ -n "$(4)" ] && ! $(call ran_tests,$(4)); then \
	  echo "== $(1): RAN NOTHING (every test skipped, or none collected): not a pass"; \
	  failed="$$failed $(1)"; \
	elif [ $$rc = 0 ]; then echo "== $(1): passed"; \
	elif [ $$rc = 124 ] || [ $$rc = 137 ]; then echo "== $(1): TIMED OUT after $(2) s"; \
	  failed="$$failed $(1)"; \
	else echo "== $(1): FAILED (exit $$rc)"; failed="$$failed $(1)"; fi
endef

# $(call gpu_run,PARTS...): the parts in order, all output also in GPU_OUT/<target>.log; the exit
# code is 0 only if every part passed
define gpu_run
mkdir -p $(GPU_OUT)
set -o pipefail; { failed=""; $(1) \
	echo "== $@: $${failed:+failed:}$${failed:- every part passed}"; test -z "$$failed"; } 2>&1 \
	| tee $(GPU_OUT)/$@.log
endef

# the GPU suite (tests/gpu; skipped where CUDA is absent, so CI never runs it), one recipe per
# pytest-xdist worker on the one GPU, then the comparison with pcdiff's kernels (PCDIFF_SRC)
test-gpu: $(GPU_SETUP)
	rm -f $(GPU_OUT)/gpu_suite.* $(GPU_OUT)/gpu_kernels.xml
	$(call gpu_run,$(call gpu_part,suite,$(SUITE_TIMEOUT),$(GPU_SUITE),$(GPU_OUT)/gpu_suite.xml); \
	  $(call gpu_part,kernels,$(KERNELS_TIMEOUT),$(GPU_KERNELS),$(GPU_OUT)/gpu_kernels.xml);)

# at the originals' sizes: training steps (fp32/bf16/fp16, compiled and not, the recipe's PVCNN2
# against pcdiff's), the point ops one by one, the issue's targets (docs/gpu.md); then the
# originals' own trainers against the recipes' presets, end to end (TRAINERS_TIMEOUT)
bench-gpu: BENCH_ARGS ?= --steps 5 --warmup 2
bench-gpu: BENCH_TIMEOUT ?= 570
bench-gpu: TRAINERS_ARGS ?= --steps 5 --warmup 2
bench-gpu: $(GPU_SETUP)
	rm -f $(GPU_OUT)/gpu_bench.* $(GPU_OUT)/trainers_bench.*
	$(call gpu_run,$(call gpu_part,bench,$(BENCH_TIMEOUT),$(GPU_BENCH)); \
	  $(call gpu_part,trainers,$(TRAINERS_TIMEOUT),$(GPU_TRAINERS));)

# the whole GPU pass in one command, at most 9 minutes on one H100: suite, benchmark (3 timed
# steps after 1 warm-up one; the targets' steps first, the rest as its time allows), kernel
# comparison, each run even if one before failed or timed out
gpu-pass: BENCH_ARGS ?= --steps 3 --warmup 1
gpu-pass: BENCH_TIMEOUT ?= 210
gpu-pass: require-gpu $(GPU_SETUP)
	rm -f $(GPU_OUT)/gpu_suite.* $(GPU_OUT)/gpu_kernels.xml $(GPU_OUT)/gpu_bench.*
	$(call gpu_run,$(call gpu_part,suite,$(SUITE_TIMEOUT),$(GPU_SUITE),$(GPU_OUT)/gpu_suite.xml); \
	  $(call gpu_part,bench,$(BENCH_TIMEOUT),$(GPU_BENCH)); \
	  $(call gpu_part,kernels,$(KERNELS_TIMEOUT),$(GPU_KERNELS),$(GPU_OUT)/gpu_kernels.xml);)

# before the install and every part: on a machine without a GPU each would skip or fail
require-gpu:
ifneq ($(REQUIRE_GPU),0)
	@nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || { echo "error: make $(MAKECMDGOALS): nvidia-smi" \
	  "lists no GPU on this machine, and the GPU pass runs nothing without one; run it on a GPU" \
	  "machine (docs/gpu.md)" >&2; exit 2; }
endif

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# each benchmark rewrites only its own section of docs/BENCHMARKS.md; the last, the originals'
# own trainers against the recipes' presets on the CPU (benchmarks/bench_trainers.py --cpu):
# their source under .originals/ unless CRICKET_SRC / COMFORMER_SRC are given, ComFormer's
# Python dependencies (not this project's) in .originals/deps/comformer
bench: CPU_CRICKET_SRC = $(or $(CRICKET_SRC),.originals/cricketmodel)
bench: CPU_COMFORMER_SRC = $(or $(COMFORMER_SRC),.originals/comformer)
bench: COMFORMER_DEPS = jarvis-tools pymatgen pymatgen-core monty spglib pytorch-ignite \
  scikit-learn joblib threadpoolctl pydantic-settings python-dotenv typing-inspection xmltodict \
  ruamel.yaml uncertainties tabulate cloudpickle narwhals orjson
bench: TRAINERS_CPU_ARGS ?= --steps 2 --warmup 1 --repeats 2 --timeout 900
bench: install
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_overhead.py --out docs/BENCHMARKS.md
	OMP_NUM_THREADS=1 $(BIN)/accel-recipes bench --out docs/BENCHMARKS.md --plot docs/scaling.png
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_graphs.py --out docs/BENCHMARKS.md
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_checkpoint_manifest.py --out docs/BENCHMARKS.md
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/bench_quality_pairs.py --out docs/BENCHMARKS.md
	@test -f $(CPU_CRICKET_SRC)/train.py || echo "bench: cricketmodel's trainer is skipped: \
	  $(CPU_CRICKET_SRC) has no train.py; fetch lyndonkl/cricketmodel and run \
	  git archive a97d68e src train.py | tar -x -C $(CPU_CRICKET_SRC) in it (or set CRICKET_SRC)"
	@test -f $(CPU_COMFORMER_SRC)/comformer/custom_train.py || echo "bench: ComFormer's trainer \
	  is skipped: $(CPU_COMFORMER_SRC) has no comformer/; fetch jwchen25/comformer and run \
	  git archive 7241ae8 | tar -x -C $(CPU_COMFORMER_SRC) in it (or set COMFORMER_SRC), then \
	  pip install --no-deps --target .originals/deps/comformer $(COMFORMER_DEPS)"
	OMP_NUM_THREADS=1 CRICKET_SRC=$(CPU_CRICKET_SRC) COMFORMER_SRC=$(CPU_COMFORMER_SRC) \
	  $(BIN)/python benchmarks/bench_trainers.py --cpu --out runs/trainers-cpu \
	  --docs docs/BENCHMARKS.md $(TRAINERS_CPU_ARGS)

clean:
	rm -rf runs data/example .pytest_cache
