"""StepInput: everything one jitted model step reads, as one pytree of device arrays.

Dimensions: T tokens in the step (padded to a bucket), S sequences (padded), B blocks per
sequence (max_model_len / block_size), P tokens per block.

Padding conventions (the model and kernels rely on them):
- padding tokens sit after `query_start_loc[-1]`; their `slot_mapping` is 0, a slot of the
  reserved null block 0, so their KV writes are harmless; their outputs are never read.
- padding sequences have a query length of 0 (`query_start_loc` repeats its last value),
  `seq_lens` 0, a block table of zeros and `logits_indices` 0.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.sample.sampler import SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array        # i32[T] input token of each position being computed
    positions: jax.Array        # i32[T] absolute position of each token in its sequence
    slot_mapping: jax.Array     # i32[T] KV-cache slot written by each token: block * P + offset
    token_seq_ids: jax.Array    # i32[T] which sequence each token belongs to (padding: 0)
    query_start_loc: jax.Array  # i32[S+1] first token of each sequence in the step; last = real T
    seq_lens: jax.Array         # i32[S] context length after this step (computed + new tokens)
    block_tables: jax.Array     # i32[S, B] physical KV block of each logical block (0 = null)
    logits_indices: jax.Array   # i32[S] token whose hidden state gives each sequence's logits
    sampling: SamplingTensors   # per-sequence sampling parameters (see sampler.py)
    next_token_ids: jax.Array | None = None  # i32[T] prompt token after each position (prompt logprobs)
    prev_token_rows: jax.Array | None = None  # i32[T] row of the previous step's output holding this
                                              # token (it was sampled there); -1: token_ids has it
    state_slots: jax.Array | None = None  # i32[S] state slot of each sequence (0: null slot)
    # Only for a model with a sliding-window cache group (kv_cache/manager.py: DeepSeek V4): its
    # arrays' blocks, by the same logical blocks as block_tables; entries before a sequence's
    # window may be stale (freed: nothing reads them). A token's slot there is found as in
    # block_tables, and it writes none where slot_mapping is the null slot.
    window_block_tables: jax.Array | None = None  # i32[S, B]
    # Only in a multi-step decode step where some sequence saves its state (hybrid prefix
    # caching): the loop copies it there after its step ending on its last block boundary.
    state_save_slots: jax.Array | None = None  # i32[S] saved-state slot (0: no save)
    lora_slots: jax.Array | None = None   # i32[T] LoRA slot of each token (0: no adapter;
                                          # only when the engine serves adapters: lora/)
    # Only in a step that verifies drafts (spec_decode/): then logits_indices and sampling
    # have R = S + D rows, the D draft rows after the sequence rows.
    draft_token_ids: jax.Array | None = None  # i32[R] the draft each logits row verifies (-1: none)
    draft_rows: jax.Array | None = None       # i32[S, K] logits row of sequence s's draft j
    num_drafts: jax.Array | None = None       # i32[S] drafts of each sequence

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

