"""Cached model folders: published whole or not at all, even by many builders or a rank > 0."""

import json
import multiprocessing
from pathlib import Path

import pytest

from grpo_run.models.model_cache import ModelCacheError, ensure_model_folder, is_complete


def write_fake_model(out: Path) -> None:
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (out / "model.safetensors").write_bytes(b"weights")


def test_a_folder_is_built_once_and_then_reused(tmp_path):
    calls = []

    def write(out: Path) -> None:
        calls.append(out)
        write_fake_model(out)

    first = ensure_model_folder(tmp_path, "m-v1", write)
    assert first == tmp_path / "m-v1" and is_complete(first)
    assert ensure_model_folder(tmp_path, "m-v1", write) == first
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m-v1"]  # no temporary folder left


def test_a_build_without_weights_is_never_published(tmp_path):
    def tokenizer_only(out: Path) -> None:  # what save_pretrained leaves on a rank > 0
        (out / "tokenizer.json").write_text("{}")
        (out / "config.json").write_text("{}")

    with pytest.raises(ModelCacheError, match="no config.json or no \\*.safetensors"):
        ensure_model_folder(tmp_path, "m-v1", tokenizer_only)
    assert list(tmp_path.iterdir()) == []  # nothing published, the temporary folder removed
    assert is_complete(ensure_model_folder(tmp_path, "m-v1", write_fake_model))  # a later build works


def test_an_incomplete_cached_folder_is_named_in_the_error(tmp_path):
    broken = tmp_path / "m-v1"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelCacheError, match=f"{broken}: an incomplete model folder"):
        ensure_model_folder(tmp_path, "m-v1", write_fake_model)


def _build(cache: str) -> bool:
    return is_complete(ensure_model_folder(cache, "m-v1", write_fake_model))


def test_concurrent_builders_all_get_the_complete_folder(tmp_path):
    with multiprocessing.get_context("fork").Pool(4) as pool:
        assert pool.map(_build, [str(tmp_path)] * 8, chunksize=1) == [True] * 8
    assert [p.name for p in tmp_path.iterdir()] == ["m-v1"]


def _rank_builds_tiny_model(rank: int, store: str, cache: str, result: str) -> None:
    import torch.distributed as dist

    from grpo_run.models.tiny import ensure_tiny_model

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ensure_tiny_model(cache)
        outcome = "built"
    except ModelCacheError as err:
        outcome = f"refused: {err}"
    Path(result).write_text(outcome)
    dist.destroy_process_group()


def test_a_rank_above_0_never_publishes_the_folder_transformers_left_without_weights(tmp_path):
    """Once torch.distributed is up, save_pretrained writes weights on rank 0 only (transformers'
    rule); rank 1's folder would break the cache, so it is refused, and the run builds it before."""
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(
            target=_rank_builds_tiny_model,
            args=(rank, str(tmp_path / "store"), str(tmp_path / f"cache{rank}"), str(tmp_path / f"r{rank}")),
        )
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert (tmp_path / "r0").read_text() == "built"
    assert (tmp_path / "r1").read_text().startswith("refused: building tiny-qwen2-v1")
    assert is_complete(tmp_path / "cache0" / "tiny-qwen2-v1")
    assert not (tmp_path / "cache1" / "tiny-qwen2-v1").exists()
