"""`lora=default` through the real `grpo-run` command on the tiny model: what trains, the reference for
free, checkpoints and exact resume, final/ and its evaluation, ZeRO-2 on 2 ranks, bad input."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo_run.trainer as trainer
from grpo_run import metrics as M
from grpo_run.config.schema import ModelConfig, ModelKind
from grpo_run.models import lora
from grpo_run.models.loading import load_model
from grpo_run.models.tiny import ensure_tiny_model
from tests.builders import ZERO2, config, run_here
from tests.helpers import FAST, adamw_tolerance, read_metrics, run_cli

QUIET = ["logger=console", "logger.console=false"]
# A learning rate at which 3 steps of the tiny model's adapters move the log-probs visibly.
LORA = [*FAST, *QUIET, "lora=default", "lora.r=4", "lora.alpha=8", "lora.lr=3e-2"]


def without_timings(rows: list[dict]) -> list[dict]:
    """Rows without timings and without alerts/*: an alert's streak restarts in a resumed process (main's
    alerts, not LoRA state: alerts/truncated was 1 vs 0 at steps 3-4 with every train/* value equal)."""
    return [{k: v for k, v in row.items() if not k.startswith(("perf/", "alerts/"))} for row in rows]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, _cache_dir) -> Path:
    """3 steps with beta > 0 (the reference is the policy with its adapter disabled) and a merged final."""
    tmp = tmp_path_factory.mktemp("lora")
    args = [*LORA, "trainer.max_steps=3", "grpo.beta=0.04", "lora.save_merged=true"]
    proc, run_dir = run_cli(args, tmp)
    assert "LoRA: " in proc.stderr and "trainable parameters of" in proc.stderr
    return run_dir


def test_kl_is_zero_at_step_1_and_positive_once_the_adapter_moved(lora_run):
    kl = [row[M.KL] for row in read_metrics(lora_run)]
    assert kl[0] == 0.0  # before the first update the adapter is zero: policy = reference bit for bit
    assert all(k > 0 for k in kl[1:]), kl
    assert all(row[M.LR] == pytest.approx(3e-2) for row in read_metrics(lora_run))  # lora.lr, not trainer.lr


def test_only_adapter_tensors_train_and_the_merged_folder_is_base_plus_adapter(lora_run, _cache_dir):
    base = load_file(ensure_tiny_model(_cache_dir) / "model.safetensors")
    # The checkpoint holds the trainable tensors only: the adapters, nothing else.
    saved = load_file(lora_run / "checkpoints" / "step_00000003" / "model.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert len(saved) == 2 * sum(1 for k in base if k.endswith("_proj.weight"))
    adapter = load_file(lora_run / "final" / "adapter_model.safetensors")
    config = json.loads((lora_run / "final" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    merged = load_file(lora_run / "final" / "merged" / "model.safetensors")
    assert merged.keys() == base.keys()
    adapted = 0
    for key, weight in base.items():
        module = key.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:  # embeddings, norms, biases, LM head: untouched, bit for bit
            assert torch.equal(merged[key], weight), key
            continue
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        assert b.abs().max() > 0, key  # B starts at zero: it trained
        # merged = base + (alpha / r) B A: the weights under the adapter are the base model's
        torch.testing.assert_close(merged[key], weight + scale * b @ a, atol=1e-6, rtol=1e-5)
        adapted += 1
    assert adapted == len(saved) // 2


def test_eval_of_a_lora_run_dir_equals_eval_of_its_merged_folder(lora_run, tmp_path, _cache_dir):
    common = [*FAST, *QUIET, "mode=eval", "eval.num_prompts=6", "eval.samples_per_prompt=2"]
    # In this process: what mode=eval builds from each folder is under test, not the command.
    from_run = run_here([*common, f"eval.checkpoint={lora_run}"], tmp_path / "run")
    from_merged = run_here([*common, f"eval.checkpoint={lora_run / 'final' / 'merged'}"], tmp_path / "merged")
    values = [json.loads((d / "eval_summary.json").read_text())["value"] for d in (from_run, from_merged)]
    for key in (M.EVAL_ACCURACY, M.EVAL_MEAN_AT_K, M.EVAL_COMPLETION_LEN):
        assert values[0][key] == values[1][key], key
    # The model mode=eval builds for the run dir (eval_mode.evaluate_only's calls): the tiny base model
    # from the adapter's recorded base folder, the adapter merged in: the merged folder's weights.
    adapter = lora.adapter_folder(str(lora_run))
    assert adapter == lora_run / "final"
    model_cfg = lora.base_model_config(ModelConfig(kind=ModelKind.TINY, cache_dir=str(_cache_dir)), adapter)
    assert Path(model_cfg.path) == ensure_tiny_model(_cache_dir)
    model = lora.merged_with_adapter(load_model(model_cfg, torch.device("cpu"), trainable=False), adapter)
    merged = load_file(lora_run / "final" / "merged" / "model.safetensors")
    state = model.state_dict()
    for key, weight in merged.items():
        assert torch.equal(state[key], weight), key


def test_stop_and_resume_with_lora_is_bitwise_identical(tmp_path):
    """4 steps in one go vs 2 steps, stop, `resume=auto` for the last 2: adapters, AdamW state, RNGs."""
    args = [*LORA, "grpo.beta=0.04", "grpo.num_iterations=2", "aggregation=per_token"]
    whole = run_here([*args, "trainer.max_steps=4"], tmp_path / "whole")  # the baseline, in this process
    _, split = run_cli([*args, "trainer.max_steps=2"], tmp_path / "split")
    proc, split = run_cli([*args, "trainer.max_steps=4", "resume=auto"], tmp_path / "split")
    assert "resumed from" in proc.stderr and "(step 2)" in proc.stderr
    assert [r["step"] for r in read_metrics(split)] == [1, 2, 3, 4]
    assert without_timings(read_metrics(split)) == without_timings(read_metrics(whole))
    a = load_file(whole / "final" / "adapter_model.safetensors")
    b = load_file(split / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_zero2_with_lora_matches_one_process_and_resumes_exactly(tmp_path, _cache_dir):
    """ZeRO-2 on 2 CPU ranks, beta > 0: 3 steps match one process's 3 steps (to AdamW's rounding); 3 steps
    in one go vs 1 step, stop, `resume=auto` for the last 2 are equal bit for bit. DeepSpeed's checkpoint
    holds the full module (frozen base weights too) and each rank's partition of the adapters' AdamW
    state; warmup 3 makes the lr (lora.lr x 1/4, 2/4, 3/4) differ at every step."""
    one = [a for a in LORA if not a.startswith(("trainer.max_steps", "trainer.micro_batch_size"))]
    one += ["trainer.micro_batch_size=2", "grpo.beta=0.04", "trainer.warmup_steps=3"]
    args = [*one, *ZERO2]
    _, whole = run_cli([*args, "trainer.max_steps=3"], tmp_path / "whole")
    trainer.train(config([*one, "trainer.max_steps=3"], tmp_path / "single"))  # in this process
    zero2, single = read_metrics(whole), read_metrics(tmp_path / "single")
    assert [r["step"] for r in zero2] == [1, 2, 3]
    for key in [M.REWARD_MEAN, M.REWARD_STD, M.COMPLETION_LEN_MEAN, M.LOSS, M.KL]:
        assert [r[key] for r in zero2] == pytest.approx([r[key] for r in single], rel=1e-5, abs=1e-7), key
    assert [r[M.GRAD_NORM] for r in zero2] == pytest.approx([r[M.GRAD_NORM] for r in single], rel=1e-4)
    a = load_file(whole / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "single" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < adamw_tolerance(lr=3e-2, steps=3)
    _, split = run_cli([*args, "trainer.max_steps=1"], tmp_path / "split")
    assert (split / "checkpoints" / "step_00000001" / "deepspeed").is_dir()
    proc, split = run_cli([*args, "trainer.max_steps=3", "resume=auto"], tmp_path / "split")
    assert "resumed from" in proc.stderr and "(step 1)" in proc.stderr
    rows = read_metrics(split)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert without_timings(rows) == without_timings(read_metrics(whole))
    # train/lr is read after the step's update, so it is the next step's lr: lora.lr's schedule continued.
    assert [r[M.LR] for r in rows] == pytest.approx([3e-2 * f for f in (0.5, 0.75, 1.0)])
    assert rows[0][M.KL] == 0.0 and all(r[M.KL] > 0 for r in rows[1:])
    # final/ is PEFT's adapter folder, written by rank 0 under the adapters' own names.
    names = {p.name for p in (split / "final").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names, names
    a = load_file(whole / "final" / "adapter_model.safetensors")
    b = load_file(split / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(ensure_tiny_model(_cache_dir) / "model.safetensors")
    projections = [k.removesuffix(".weight") for k in base if k.endswith("_proj.weight")]
    assert sorted(a) == sorted(f"base_model.model.{m}.lora_{x}.weight" for m in projections for x in "AB")
    assert all(a[f"base_model.model.{m}.lora_B.weight"].abs().max() > 0 for m in projections)
    # mode=eval evaluates the ZeRO-2 run dir: the base model the adapter recorded, the adapter merged in.
    eval_args = [*FAST, *QUIET, "mode=eval", "eval.num_prompts=2", "eval.samples_per_prompt=1"]
    proc, evaluated = run_cli([*eval_args, f"eval.checkpoint={split}"], tmp_path / "eval")
    assert f"evaluated {ensure_tiny_model(_cache_dir)}" in " ".join(proc.stderr.split())
    assert M.EVAL_ACCURACY in json.loads((evaluated / "eval_summary.json").read_text())["value"]


def test_lora_rank_0_exits_2_before_any_model_loads(tmp_path):
    proc, _ = run_cli([*LORA, "lora.r=0"], tmp_path, check=False)
    assert proc.returncode == 2
    assert "lora.r=0" in proc.stderr


def test_a_target_module_naming_nothing_exits_2_listing_the_model_linear_modules(tmp_path):
    proc, run_dir = run_cli([*LORA, "lora.target_modules=[q_proj,query]"], tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "lora.target_modules" in out and "'query'" in out
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in out
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_bf16_lora_run_samples_from_the_merged_copy_and_loads_no_reference(tmp_path):
    """The wiring of build_context: float32 weights under bf16 autocast sample from the merged bf16 copy;
    beta > 0 loads no second model (the reference is the adapter disabled); casts are off with LoRA."""
    from grpo_run.run_context import build_context
    from tests.builders import config

    cfg = config([*LORA, "model.autocast_bf16=true", "grpo.beta=0.04"], tmp_path / "run")
    ctx = build_context(cfg)
    try:
        assert isinstance(ctx.generation.weights, lora.MergedSamplingWeights)
        assert ctx.reference is None and ctx.lora is not None
        with ctx.reference_model() as reference:
            assert reference is ctx.policy
        assert not ctx.forward.cast_weights_once
    finally:
        ctx.close()
