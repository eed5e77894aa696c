"""mode=plan's memory terms (grpo_run/plan/memory.py), each with its arithmetic on a toy model."""

import pytest

from grpo_run.plan import memory as mem
from grpo_run.plan.memory import MemoryInputs, ModelDims, estimate, with_changes

# 2 layers, hidden 4, MLP 8, 2 query heads and 1 key-value head of 2 dims, 10-token vocabulary.
DIMS = ModelDims(
    params=1000,
    vocab=10,
    hidden=4,
    intermediate=8,
    layers=2,
    heads=2,
    kv_heads=1,
    head_dim=2,
    max_positions=64,
)
# float32 throughout; 8 completions (2 prompts x G=4) in micro-batches of 4; prompts of 3, completions of 5.
X = MemoryInputs(
    dims=DIMS,
    weight_bytes=4,
    activation_bytes=4,
    rows=8,
    group_size=4,
    micro_batch=4,
    prompt_len=3,
    completion_len=5,
)


def test_state_terms_one_process_zero_and_offload():
    assert mem.weights(X) == 1000 * 4 == 4000
    assert mem.gradients(X) == 4000
    assert mem.optimizer_state(X) == 1000 * (2 * 4)  # AdamW's two moments in the weights' dtype
    z2 = with_changes(X, world=2, zero_stage=2)
    assert mem.gradients(z2) == 2000  # ZeRO-2: this rank's half
    assert mem.optimizer_state(z2) == 1000 * 8 // 2 == 4000
    z1 = with_changes(X, world=2, zero_stage=1)
    assert mem.gradients(z1) == 4000  # ZeRO-1 shards only the optimizer state
    bf16 = with_changes(X, world=2, zero_stage=2, weight_bytes=2)
    assert mem.optimizer_state(bf16) == 1000 * (4 + 4 + 4) // 2 == 6000  # float32 moments + master copy
    off = with_changes(bf16, offload_optimizer=True)
    assert mem.optimizer_state(off) == 0 and mem.host_optimizer_state(off) == 6000


def test_reference_and_lora():
    assert mem.reference_model(X) == 0
    assert mem.reference_model(with_changes(X, reference=True)) == 4000
    lora = with_changes(X, reference=True, lora_rank=2, lora_targets=("q_proj", "v_proj"))
    # q_proj 4 -> 4: 2 * (4 + 4) = 16; v_proj 4 -> 2: 2 * (4 + 2) = 12; 28 a layer, 2 layers.
    assert mem.lora_params(DIMS, 2, ("q_proj", "v_proj")) == 56
    assert mem.lora_weights(lora) == 56 * 4
    assert mem.gradients(lora) == 56 * 4 and mem.optimizer_state(lora) == 56 * 8
    assert mem.reference_model(lora) == 0  # the reference is the base with the adapter disabled


def test_a_teacher_is_resident_in_every_phase_and_its_logprobs_are_kept():
    assert mem.teacher_model(X) == 0 and estimate(X).components["teacher_model"] == 0
    # a teacher of 500 float32 weights on this device (plan.inputs counts them from its config.json)
    teacher = with_changes(X, teacher_bytes=500 * 4, distill=True)
    est, base = estimate(teacher), estimate(X)
    assert all(est.phases[p] - base.phases[p] >= 2000 for p in base.phases)  # resident: every phase
    # the step's log-probs: 8 rows x 5 completion tokens x 4 bytes, twice more (the teacher's, the student's)
    assert mem.rollout_tensors(teacher) - mem.rollout_tensors(X) == 2 * 8 * 5 * 4


def test_positions_and_saved_tensors():
    # Shared prompt: 1 prompt of 3 positions + 4 completions of 5 = 23; else 4 rows of 3 + 5 = 32.
    assert mem.prompt_positions(X, 4) == 3 + 4 * 5 == 23
    assert mem.prompt_positions(with_changes(X, shared_prompt=False), 4) == 32
    assert mem.prompt_positions(X, 2) == 3 + 2 * 5  # fewer rows than G: still one prompt
    # Residual stream into 2 norms: 2 * 4 * 4 B = 32; kept 2*4 + 2*4 (q, attn out) + 2*2 (k, v) + 2*8 = 36
    # values of 4 B = 144; 176 in all. transformers' forward keeps 2 * 8 more: 52 * 4 + 32 = 240.
    assert mem.saved_per_position(X) == 176
    assert mem.saved_per_position(with_changes(X, native_forward=False)) == 240
    # Scores: 2 heads * (1 prompt * 3 * 3 + 4 rows * 5 queries * 8 keys) = 338 entries of 4 + 4 + 4 B.
    assert mem.attention_scores(X, 4) == 338 * 12 == 4056
    # Unshared: 2 heads * 4 rows * 8 * 8 = 512 entries.
    assert mem.attention_scores(with_changes(X, shared_prompt=False), 4) == 512 * 12


def test_activations_with_and_without_checkpointing():
    one_layer = 23 * 176 + 4056  # 8104
    assert mem.activations(X) == 2 * one_layer == 16208
    # Checkpointed: 2 layers' inputs (23 positions x hidden 4 x 4 B) + one layer recomputed.
    assert mem.activations(with_changes(X, gradient_checkpointing=True)) == 2 * 23 * 16 + one_layer == 8840
    # transformers' eager attention also keeps each layer's score matrices (unshared: 32 positions).
    hf = with_changes(X, native_forward=False)
    assert mem.activations(hf) == 2 * (32 * 240 + 2 * 512 * 12)


def test_logprob_buffers_fused_and_not():
    # 4 rows x 5 tokens = 20 rows of the log-softmax (< 256): a chunk is 20 x 10 x 4 B = 800;
    # the head's input and its gradient: 2 x 20 x 4 x 4 B = 640.
    assert mem.logprob_buffers(X) == 3 * 800 + 640 == 3040
    # Unfused: [20, 10] logits and their gradient (4 B) + 2 chunk buffers + the head's input.
    assert mem.logprob_buffers(with_changes(X, fused_head=False)) == 2 * 20 * 10 * 4 + 2 * 800 + 640
    assert mem.logprob_buffers(with_changes(X, chunk_rows=8)) == 3 * (8 * 10 * 4) + 640


def test_kv_cache_and_vllm():
    # 8 rows x 8 positions x 2 layers x (k, v) x 1 head x 2 dims x 4 B = 2048; + 2 x [8, 10] float32 = 640.
    assert mem.kv_cache(X) == 2048 + 640
    assert mem.kv_cache(with_changes(X, sampling_copy=True)) == 1024 + 640  # the bf16 copy decodes
    assert mem.kv_cache(with_changes(X, vllm_reserved_bytes=10**6)) == 0  # the reservation holds it


def test_phases_add_their_terms():
    est = estimate(X)
    rollout = 8 * (3 * 8 * 8 + 3 * 5 * 4)  # ids/masks int64 + log-probs, advantages, mask float32
    assert est.components["rollout_tensors"] == rollout == 2016
    assert est.phases["generation"] == 4000 + 8000 + 2688 + rollout
    assert est.phases["update"] == 4000 + 4000 + 8000 + 16208 + 3040 + rollout
    assert est.peak == est.phases["update"] and est.peak_phase == "update"
    # The optimizer step: the activations are gone, the gradients and the update-norm copy are held.
    assert est.components["update_snapshot"] == 4000  # every trainable weight, one process
    assert est.phases["optimizer_step"] == 4000 + 8000 + 4000 + 4000 + rollout
    assert mem.update_snapshot(with_changes(X, world=2, zero_stage=2)) == 2000  # each rank its half
    half = with_changes(
        X, weight_bytes=4, activation_bytes=2, sampling_copy=True, weight_casts=True, runtime_bytes=7
    )
    e2 = estimate(half)
    assert e2.components["sampling_copy"] == e2.components["weight_casts"] == 1000 * 2
    # The copy adds its 2000 B; the KV cache is bf16 under autocast either way.
    assert (
        e2.phases["generation"] - estimate(with_changes(half, sampling_copy=False)).phases["generation"]
        == 2000
    )
    vllm = estimate(with_changes(X, vllm_reserved_bytes=50_000))
    assert vllm.phases["generation"] == 4000 + 8000 + 50_000 + rollout  # no KV cache of ours
    assert vllm.phases["update"] == est.phases["update"] + 50_000  # colocated: held through the update


def test_a_reward_model_on_this_device_is_held_through_every_phase():
    est = estimate(X)
    rm = estimate(with_changes(X, reward_model_bytes=3000))  # its worker's weights, loaded once, kept
    assert rm.components["reward_models"] == 3000
    assert {p: rm.phases[p] - est.phases[p] for p in est.phases} == dict.fromkeys(est.phases, 3000)


def test_evaluation_phase_when_evaluating():
    assert "evaluation" not in estimate(X).phases
    ev = with_changes(X, eval_rows=20, eval_completion_len=9)
    # 20 rows x (3 + 9) positions x 2 layers x (k, v) x 2 dims x 4 B = 7680; + 2 x [20, 10] float32 = 1600.
    assert mem.eval_kv_cache(ev) == 7680 + 1600
    assert estimate(ev).phases["evaluation"] == 4000 + 8000 + 9280  # weights, optimizer state, its cache


@pytest.mark.parametrize("mb", [1, 2, 4, 8])
def test_smaller_micro_batches_never_need_more(mb):
    assert estimate(with_changes(X, micro_batch=mb)).peak <= estimate(with_changes(X, micro_batch=8)).peak


def test_suggestions_cheapest_first_and_combined_when_none_fits_alone():
    from types import SimpleNamespace

    from grpo_run.plan.arithmetic import suggestions

    cfg = SimpleNamespace(trainer=SimpleNamespace(prompts_per_step=2))
    big = with_changes(X, gradient_checkpointing=False)
    full = estimate(big).peak
    half = estimate(with_changes(big, micro_batch=2)).peak
    # A budget between the half micro-batch's peak and the full one's: halving it is the first change.
    first = suggestions(cfg, big, (full + half) // 2)[0]
    assert first["overrides"] == "trainer.micro_batch_size=2" and first["peak_bytes"] == half
    # Below anything one change reaches: the smallest micro-batch plus further changes, together.
    alone = min(
        estimate(with_changes(big, **c)).peak for c in ({"micro_batch": 1}, {"gradient_checkpointing": True})
    )
    combined = estimate(with_changes(big, micro_batch=1, gradient_checkpointing=True)).peak
    assert combined < alone
    (only,) = suggestions(cfg, big, combined)
    assert only["overrides"].startswith("trainer.micro_batch_size=1 model.gradient_checkpointing=true")
    assert only["fits"] and only["peak_bytes"] <= combined


def test_the_plan_counts_a_teacher_on_the_policys_device_only(tmp_path):
    from grpo_run.models.tiny import tiny_config
    from grpo_run.plan.inputs import count_params, teacher_bytes
    from tests.builders import compose_config, write_tiny_teacher

    folder = write_tiny_teacher(tmp_path / "teacher")
    args = ["model=tiny", "distill=teacher", f"distill.teacher.path={folder}"]
    params = count_params(tiny_config())  # the teacher is another tiny model: its config.json's shapes
    assert teacher_bytes(compose_config(args), policy_params=0) == params * 4  # float32, the policy's dtype
    assert teacher_bytes(compose_config([*args, "distill.teacher.dtype=bfloat16"]), 0) == params * 2
    assert teacher_bytes(compose_config([*args, "distill.teacher.device=cpu"]), 0) == 0  # a device of its own
    assert teacher_bytes(compose_config(["model=tiny", "distill=self"]), 0) == 0  # no second model


def test_the_distribution_form_keeps_the_teachers_head_states_and_walks_the_vocabulary_in_blocks():
    from grpo_run.plan.memory import DIVERGENCE_BLOCK_TENSORS, FLOAT32

    base = estimate(with_changes(X, distill=True))
    est = estimate(with_changes(X, distill=True, distill_distribution=True, teacher_head_copy=True))
    d = X.dims
    states = X.rows * X.completion_len * d.hidden * X.activation_bytes + d.vocab * d.hidden * X.weight_bytes
    assert est.components["teacher_states"] == states
    assert est.components["divergence_blocks"] == DIVERGENCE_BLOCK_TENSORS * X.chunk_rows * d.vocab * FLOAT32
    assert est.phases["update"] - base.phases["update"] == states + est.components["divergence_blocks"]
    assert est.phases["generation"] == base.phases["generation"]
    assert base.components["teacher_states"] == base.components["divergence_blocks"] == 0
