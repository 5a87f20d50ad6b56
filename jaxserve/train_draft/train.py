"""The loss, the optimizer and the jitted training step, and the held-out metrics.

Loss of TTT step i at position t (valid while token t + 1 + i, its input, exists, and
token t + 2 + i, its prediction, is one the loss is on: data.Example.train_from): the
forward KL from the target's distribution at position t + 1 + i, restricted to the draft
vocabulary and renormalised, to the head's (the cross-entropy less the target's entropy:
the same gradient, and 0 when the head matches). Positions whose target top-1 lies outside
the draft vocabulary are left out of the loss (no draft there can be accepted) but count as
misses in the acceptance figures.
Steps are weighted 0.8^i (EAGLE3's weights: later steps matter less, they are reached less).

Acceptance estimate of step i: the share of positions where the head's top-1 (as a target
id) equals the target's top-1 at steps 0..i all together: a greedy chain of i + 1 drafts
from that position would keep them all (with the dataset's tokens standing in for the
target's along the chain). 1 + their sum over-states what the engine measures: the engine
drafts only where its last step ended, and after a miss it drafts again one token on, so
the positions it visits are weighted towards the hard ones. `walk_acceptance` visits them
as the engine would (exact when the replies are the target's greedy ones, --regenerate).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxserve.train_draft.head import Eagle3Head, shift_left

STEP_WEIGHT = 0.8
CLIP_NORM = 0.5


def make_optimizer(head: Eagle3Head, lr: float, num_steps: int, warmup_steps: int,
                   weight_decay: float) -> nnx.Optimizer:
    """AdamW on a warmup-then-cosine schedule (to 10 % of lr), gradients clipped, over the
    head's Params (its state f32, as they are)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(1, min(warmup_steps, num_steps - 1)), max(2, num_steps), lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adamw(schedule, weight_decay=weight_decay))
    return nnx.Optimizer(head, tx, wrt=nnx.Param)


def _step_arrays(head: Eagle3Head, embed, aux, token_ids, lengths, train_from, tgt_logits, tgt_top1,
                 in_draft, num_steps, compute_dtype):
    """Per TTT step, at every position: (KL, in the loss, chained agreement, valid), [B, T]."""
    logits = head(embed, aux, token_ids, num_steps, compute_dtype)
    draft_ids = head.draft_ids[...]
    t = token_ids.shape[1]
    chained = jnp.ones(token_ids.shape, bool)
    out = []
    for i, lg in enumerate(logits):
        # step i at t predicts the token after t + 1 + i: the target's logits at t + 1 + i
        pos = jnp.arange(t)[None, :]
        valid = (pos + 1 + i < lengths[:, None]) & (pos + 2 + i >= train_from[:, None])
        log_p = jax.nn.log_softmax(shift_left(tgt_logits, 1 + i).astype(jnp.float32), -1)
        p = jnp.exp(log_p)
        kl = jnp.sum(p * (log_p - jax.nn.log_softmax(lg, -1)), -1)
        mask = valid & shift_left(in_draft, 1 + i)
        chained &= draft_ids[jnp.argmax(lg, -1)] == shift_left(tgt_top1, 1 + i)
        out.append((kl, mask, chained & valid, valid))
    return out


def _sum_terms(arrays):
    """Per TTT step: (loss sum, loss positions, agreements chained, valid positions)."""
    return [(jnp.sum(jnp.where(mask, kl, 0.0)), jnp.sum(mask), jnp.sum(hit), jnp.sum(valid))
            for kl, mask, hit, valid in arrays]


def loss_fn(head: Eagle3Head, embed, batch, num_steps, compute_dtype):
    terms = _sum_terms(_step_arrays(head, embed, *batch, num_steps, compute_dtype))
    losses = [s / jnp.maximum(n, 1) for s, n, _, _ in terms]
    total = sum(STEP_WEIGHT ** i * l for i, l in enumerate(losses))
    return total, (jnp.stack(losses), jnp.stack([a / jnp.maximum(v, 1) for _, _, a, v in terms]))


def make_train_step(graphdef: nnx.GraphDef, num_steps: int, compute_dtype=jnp.float32):
    """jit(state, embed, batch) -> (state, loss, per-step losses, per-step chained agreement).

    graphdef, state = nnx.split((head, optimizer)): the step merges them, takes the gradient
    of the loss with respect to the head's Params and lets the optimizer update the head,
    and returns the new state, donating the old one. The caller carries the state from
    step to step and merges it when it wants the head back: a jax.jit over the state's
    arrays, not nnx.jit over the objects, so that a step's dispatch costs no walk over the
    module graph. batch = (aux, token_ids, lengths, train_from, target logits, target
    top-1, its being in the draft vocabulary): target.make_target_fn's outputs and the
    data's. The head's matmuls run in compute_dtype (its Params and the AdamW state stay f32)."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, embed, batch):
        head, optimizer = nnx.merge(graphdef, state)
        (loss, (per_step, acc)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
            head, embed, batch, num_steps, compute_dtype)
        optimizer.update(head, grads)
        return nnx.state((head, optimizer)), loss, per_step, acc

    return step


def make_eval_step(num_steps: int, compute_dtype=jnp.float32):
    """nnx.jit(head, embed, batch) -> (f32[num_steps, 4]: per step the loss sum, loss
    positions, chained agreements and valid positions (summed over batches by the caller);
    i32[B, T]: at each position the drafts a greedy chain from there keeps, walk_acceptance's
    input)."""

    @nnx.jit
    def evaluate(head: Eagle3Head, embed, batch):
        arrays = _step_arrays(head, embed, *batch, num_steps, compute_dtype)
        sums = jnp.stack([jnp.stack([jnp.asarray(x, jnp.float32) for x in term]) for term in _sum_terms(arrays)])
        return sums, sum(h.astype(jnp.int32) for _, _, h, _ in arrays)

    return evaluate


def walk_acceptance(kept_BT, lengths, train_from, max_new: int | None = None) -> tuple[int, int]:
    """(drafts kept, verifying steps) of greedy speculation over each row as the engine runs it:
    the first drafts come from the position before the reply's first token (its token is
    the target's own, from the prompt's pass), and after a step that kept a drafts the
    next drafts come a + 1 positions on; a step drafts no more than leaves room for its own
    token before the reply's end (drafting.draft_limit), and none when that is no draft.
    max_new: only the reply's first max_new tokens (an engine run's max_tokens)."""
    import numpy as np

    kept_BT = np.asarray(kept_BT)
    accepted = steps = 0
    for row, n, start in zip(kept_BT, np.asarray(lengths), np.asarray(train_from)):
        start = max(int(start), 1)
        end = int(n) if max_new is None else min(int(n), start + max_new)
        t = start - 1                       # t + 2 tokens known: drafts the token at t + 2 on
        while t + 4 <= end:
            a = min(int(row[t]), end - (t + 3))
            accepted, steps, t = accepted + a, steps + 1, t + a + 1
    return accepted, steps


def walk_mean_length(walk: tuple[int, int]) -> float:
    """Tokens kept per verifying step of walk_acceptance's sums (the engine's
    spec_decode.metrics.mean_acceptance_length)."""
    return 1.0 + walk[0] / max(walk[1], 1)


def summarize(sums, walk: tuple[int, int] | None = None) -> dict:
    """Held-out figures from summed eval_step outputs: loss and acceptance per position, the
    mean acceptance length a greedy chain of that many drafts would give at every position,
    and (walk: walk_acceptance's sums) the one the engine's walk over the replies gives."""
    import numpy as np

    sums = np.asarray(sums, np.float64)
    loss = (sums[:, 0] / np.maximum(sums[:, 1], 1)).tolist()
    accept = (sums[:, 2] / np.maximum(sums[:, 3], 1)).tolist()
    return {"loss_per_position": loss, "acceptance_per_position": accept,
            "mean_acceptance_length_estimate": 1.0 + float(sum(accept)),
            "positions": int(sums[0, 3]),
            **({"mean_acceptance_length_walk": walk_mean_length(walk)} if walk else {})}
