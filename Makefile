# grpo-run — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
EXTRAS ?= dev
MODEL ?= tiny
REWARD ?=
ARGS ?=
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.DEFAULT_GOAL := help
.PHONY: help install train test test-fast lint format clean

help:  ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# No NVIDIA GPU: take the CPU wheel first, so nothing pulls a multi-GB CUDA build.
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q torch; else $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install grpo-run (editable) with its dependencies

train: install  ## train: make train MODEL=tiny REWARD=format ARGS="trainer.max_steps=5"
	$(VENV)/bin/grpo-run model=$(MODEL) $(if $(REWARD),reward=$(REWARD)) $(ARGS)

test: install  ## run the whole test suite (CPU, no network)
	$(PY) -m pytest -q tests

test-fast: install  ## unit tests only
	$(PY) -m pytest -q tests/unit

lint: install  ## ruff check + format check
	$(PY) -m ruff check grpo_run tests scripts
	$(PY) -m ruff format --check grpo_run tests scripts

format: install  ## apply ruff fixes and formatting
	$(PY) -m ruff check --fix grpo_run tests scripts
	$(PY) -m ruff format grpo_run tests scripts

clean:  ## remove run outputs and caches (keeps .venv)
	rm -rf outputs/* multirun .pytest_cache .ruff_cache
	touch outputs/.gitkeep
