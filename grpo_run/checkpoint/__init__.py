"""Checkpoints: save the whole training state atomically, find the one to resume, restore it exactly.

Layout under the run dir:

    checkpoints/
      step_00000004/          one complete checkpoint
        model.safetensors     \\
        optimizer.pt           } the engine's files (DeepSpeed writes its own sharded layout instead)
        scheduler.pt          /
        rng_rank0.pt          python, numpy, torch (and CUDA) RNG states, one file per rank
        config.json           the run's config, what a resume compares its command line against
        trainer_state.json    step, sampler position, beta, non-finite streak, alarms, W&B run id
        manifest.json         size and sha256 of every other file (written last)
      step_00000005-iter1/    a stop inside step 5 (grpo.num_iterations > 1) after its first optimizer
        ...                   step: the same files (trainer_state.json: step 4, iterations_done 1) and
        step_remainder_rank0.pt   the rest of step 5, one file per rank (`grpo_run/step_remainder.py`)
      latest                  the name of the newest complete checkpoint
      .tmp-step_00000005/     a save in progress, or one killed mid-write: never resumed, removed later

A save writes everything into `.tmp-<name>` on the same filesystem, waits for every rank
(`engine.barrier`), fsyncs, renames the folder to `<name>` and only then replaces `latest` (an atomic
rename too). A process killed at any point leaves `latest` naming the previous complete checkpoint.
Files are read back with safetensors and `torch.load(weights_only=True)`: never arbitrary pickles.

One module per job: `save` (the atomic write, pruning), `resume` (finding, verifying and restoring),
`manifest` (checksums), `state` (the state file's format), `folders` (which folders count),
`metrics_log` (metrics.jsonl on resume), `wandb_id` (the W&B run a resume continues).
"""

from grpo_run.checkpoint.folders import (
    complete_checkpoints,
    describe_saved,
    newest_complete,
    newest_position,
    newest_step,
    refuse_symlinks,
    restore_set_aside,
)
from grpo_run.checkpoint.manifest import MANIFEST, write_manifest
from grpo_run.checkpoint.resume import (
    damage,
    find_resume,
    newest_intact,
    prepare_run_dir,
    restore,
    set_rng_state,
)
from grpo_run.checkpoint.save import is_due, prune, publish, remove_unfinished, rng_state, save
from grpo_run.checkpoint.state import (
    AUTO,
    CHECKPOINTS,
    FORMAT_VERSION,
    LATEST,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    TrainerState,
    describe_position,
    folder_name,
    read_state,
    step_name,
)
from grpo_run.checkpoint.wandb_id import wandb_run_id

__all__ = [
    "AUTO",
    "CHECKPOINTS",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "STATE_FILE",
    "TMP_PREFIX",
    "CheckpointError",
    "TrainerState",
    "complete_checkpoints",
    "damage",
    "describe_position",
    "describe_saved",
    "find_resume",
    "folder_name",
    "restore_set_aside",
    "write_manifest",
    "is_due",
    "newest_complete",
    "newest_intact",
    "newest_position",
    "newest_step",
    "prepare_run_dir",
    "prune",
    "publish",
    "read_state",
    "refuse_symlinks",
    "remove_unfinished",
    "restore",
    "rng_state",
    "save",
    "set_rng_state",
    "step_name",
    "wandb_run_id",
]
