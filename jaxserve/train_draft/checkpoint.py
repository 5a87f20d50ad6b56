"""Resumable training state with orbax-checkpoint: the nnx state of (head, optimizer) (the
head's Params and draft vocabulary, the optimizer's step and AdamW state), the run's
settings as JSON, under OUTPUT/checkpoints/<step>.

A resumed run restores the latest step and continues the data stream there
(data.train_batch is a function of the step); settings that change what is trained (the
draft vocabulary's size, the aux layers, the TTT steps) must match the saved ones.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

# Settings a resumed run must share with the saved one.
MUST_MATCH = ("draft_vocab_size", "aux_layers", "ttt_steps", "model", "regenerate")


def manager(output_dir: str, keep: int = 2) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.abspath(os.path.join(output_dir, "checkpoints")),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save(mgr: ocp.CheckpointManager, step: int, state: nnx.State, settings: dict) -> None:
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           settings=ocp.args.JsonSave(settings)), force=True)
    mgr.wait_until_finished()


def restore(mgr: ocp.CheckpointManager, like: nnx.State, settings: dict) -> tuple[int, nnx.State] | None:
    """(step, state shaped as `like`, e.g. a fresh run's) of the latest checkpoint, or None
    when there is none."""
    step = mgr.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                    settings=ocp.args.JsonRestore()))
    saved = got["settings"]
    for key in MUST_MATCH:
        if saved.get(key) != settings.get(key):
            raise ValueError(f"--resume: {key} must match the checkpoint's ({saved.get(key)!r} "
                             f"at step {step}); got {settings.get(key)!r}")
    return step, got["state"]
