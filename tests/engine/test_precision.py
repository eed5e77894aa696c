"""model.autocast_bf16=auto: bf16 where the hardware computes it, resolved once at the door
(grpo_run/config/precision.py decides, grpo_run/config/convert.py applies it to the typed config)."""

import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from grpo_run.cli import CONF_DIR
from grpo_run.config import ConfigError, precision, to_config
from grpo_run.config.convert import precision_note
from grpo_run.config.saved_run import checkpoint_model_settings
from grpo_run.config.schema import ModelConfig, ModelKind
from grpo_run.engine import device
from grpo_run.safety.resume_policy import ResumeConfigError, check_resume, save_config
from tests.builders import compose_config

# Trimmed /proc/cpuinfo texts: the AVX2-only AMD EPYC these machines are, CPUs with bf16 matmuls, an ARM.
AMD_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
AMD_ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 fma\n"
XEON_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16\n"


def resolve(setting, device_type="cpu", cpuinfo=None, cuda_bf16=False):
    return device.resolve_autocast_bf16(setting, device_type, cpuinfo=cpuinfo, cuda_bf16=cuda_bf16)


def test_auto_on_a_cpu_reads_the_flags_line():
    assert resolve("auto", cpuinfo=AMD_AVX2) == (
        False,
        "precision: float32 (auto: this CPU has no avx512_bf16/amx_bf16, torch would emulate bf16)",
    )
    assert resolve("auto", cpuinfo=AMD_ZEN4) == (
        True,
        "precision: bf16 autocast (auto: this CPU has avx512_bf16)",
    )
    assert resolve("auto", cpuinfo=XEON_AMX) == (
        True,
        "precision: bf16 autocast (auto: this CPU has amx_bf16)",
    )
    # No x86 flags line (another architecture, or no /proc/cpuinfo at all): unknown, so float32, said so.
    for unknown in (ARM, "", None):
        on, line = resolve("auto", cpuinfo=unknown)
        assert on is False and "no x86 flags" in line and line.startswith("precision: float32")


def test_auto_on_cuda_follows_the_device_not_the_cpu():
    assert resolve("auto", "cuda", cpuinfo=AMD_AVX2, cuda_bf16=True) == (
        True,
        "precision: bf16 autocast (auto: CUDA device with bf16)",
    )
    on, line = resolve("auto", "cuda", cpuinfo=AMD_ZEN4, cuda_bf16=False)  # e.g. a V100: emulated bf16
    assert on is False and "no bf16" in line


@pytest.mark.parametrize("setting", [True, False])
def test_an_explicit_setting_wins_on_any_hardware(setting):
    word = str(setting).lower()
    for device_type, cpuinfo, cuda_bf16 in [
        ("cpu", AMD_AVX2, False),
        ("cpu", XEON_AMX, False),
        ("cuda", None, True),
    ]:
        assert resolve(setting, device_type, cpuinfo, cuda_bf16) == (
            setting,
            f"precision: {'bf16 autocast' if setting else 'float32'} (model.autocast_bf16={word})",
        )


@pytest.fixture
def avx2_cpu(monkeypatch):
    """This machine as the door sees it: no GPU, an AVX2-only CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "read_cpuinfo", lambda: AMD_AVX2)


def test_the_default_run_on_an_avx2_cpu_trains_in_float32(avx2_cpu):
    cfg = compose_config([])
    assert cfg.model.kind == "smollm2" and cfg.model.autocast_bf16 is False  # a plain bool, not "auto"
    assert precision_note(False) == (
        "precision: float32 (auto: this CPU has no avx512_bf16/amx_bf16, torch would emulate bf16)"
    )


def test_the_default_run_on_a_bf16_cpu_or_gpu_autocasts(monkeypatch, avx2_cpu):
    monkeypatch.setattr(precision, "read_cpuinfo", lambda: XEON_AMX)
    assert compose_config([]).model.autocast_bf16 is True
    monkeypatch.setattr(precision, "read_cpuinfo", lambda: AMD_AVX2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precision, "cuda_computes_bf16", lambda: True)
    assert compose_config([]).model.autocast_bf16 is True
    assert compose_config(["trainer.device=cpu"]).model.autocast_bf16 is False
    monkeypatch.setattr(precision, "cuda_computes_bf16", lambda: False)
    assert compose_config([]).model.autocast_bf16 is False


@pytest.mark.parametrize(
    "override,value",
    [("model.autocast_bf16=true", True), ("model.autocast_bf16=false", False)]
    + [("model.autocast_bf16='true'", True), ("model.autocast_bf16='false'", False)],
)
def test_true_and_false_keep_their_meaning(avx2_cpu, override, value):
    cfg = compose_config([override])
    assert cfg.model.autocast_bf16 is value
    assert (
        precision_note(value)
        == f"precision: {'bf16 autocast' if value else 'float32'} (model.autocast_bf16={str(value).lower()})"
    )


@pytest.mark.parametrize(
    "value,shown", [("maybe", "'maybe'"), ("1", "1"), ("null", "None"), ("bf16", "'bf16'")]
)
def test_a_bad_value_names_the_key_and_the_value(avx2_cpu, value, shown):
    with pytest.raises(
        ConfigError, match=re.escape(f"model.autocast_bf16={shown}: must be true, false or auto")
    ):
        compose_config([f"model.autocast_bf16={value}"])


def test_a_plan_for_a_named_gpu_counts_bf16(avx2_cpu):
    # plan/inputs.resolve_device plans plan.gpu's preset even on this GPU-less machine: bf16 there.
    assert compose_config(["mode=plan", "plan.gpu=h100"]).model.autocast_bf16 is True
    assert compose_config(["mode=plan"]).model.autocast_bf16 is False  # this machine's RAM: its CPU


def _raw(overrides, run_dir):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        raw = compose(config_name="config", overrides=overrides)
    with open_dict(raw):
        raw.run_dir = str(run_dir)
    return raw


def test_the_saved_configs_hold_the_resolved_bool_and_auto_resumes_them(avx2_cpu, tmp_path):
    raw = _raw([], tmp_path / "run")
    cfg = to_config(raw)
    # config_resolved.yaml (written from the composed config) records what ran, for mode=eval.
    assert OmegaConf.to_yaml(raw, resolve=True).count("autocast_bf16: false") == 1
    save_config(cfg, tmp_path)  # a checkpoint's config.json
    # Resumed with the same command line (auto) on the same machine: nothing changed.
    assert check_resume(to_config(_raw(["resume=auto"], tmp_path / "run")), tmp_path) == []
    # A checkpoint trained with bf16 (explicitly, or auto on other hardware) is refused by name here.
    with pytest.raises(ResumeConfigError, match=re.escape("model.autocast_bf16=False")):
        check_resume(
            to_config(_raw([], tmp_path / "run")), _checkpoint(tmp_path, ["model.autocast_bf16=true"])
        )


def _checkpoint(root, overrides):
    folder = root / "bf16"
    folder.mkdir()
    save_config(to_config(_raw(overrides, root / "run")), folder)
    return folder


def test_an_eval_of_a_run_dir_whose_saved_setting_is_auto_uses_this_machines_choice(tmp_path):
    run = tmp_path / "train"
    (run / "final").mkdir(parents=True)
    saved = OmegaConf.structured(ModelConfig(kind=ModelKind.SMOLLM2, cache_dir="/c"))  # autocast_bf16: auto
    (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml({"model": saved}))
    configured = ModelConfig(kind=ModelKind.SMOLLM2, autocast_bf16=False, cache_dir="/c")  # the door's
    model, line = checkpoint_model_settings(run / "final", configured, str(tmp_path / "eval"))
    assert model.autocast_bf16 is False and "autocast_bf16=False" in line
