"""Ragged paged attention: one kernel for decode rows and prefill chunks in the same batch.

Every sequence s owns the query tokens query_start_loc[s] : query_start_loc[s+1] of the step
(qlen_s of them) and a context of seq_lens[s] keys in the paged cache, this step's keys
included. Query token i of sequence s sits at absolute position seq_lens[s] - qlen_s + i and
sees the keys at positions 0..that position (the last `sliding_window` of them if set). Decode
rows are simply sequences with qlen 1; GQA shares each kv head among G = N // K query heads.

Layouts (per layer):
    q_TNE           f[T, N, E]     this step's queries (tokens after query_start_loc[-1] are
                                   padding: their output is written as zeros)
    k_cache_NPKE    f[NB, P, K, E] paged keys   (NB cache blocks of P slots; block 0 = null)
    v_cache_NPKE    f[NB, P, K, E] paged values
    query_start_loc i32[S+1]       first token of each sequence; padding sequences repeat it
    seq_lens        i32[S]         context length after this step (0 for padding sequences)
    block_tables    i32[S, B]      physical block of each logical block of each sequence
    -> o_TNE        f[T, N, E]

Legend: T tokens, S sequences, N query heads, K kv heads, G = N // K, E head dim, NB cache
blocks, P slots per block, B blocks per sequence, J query tiles, BQ tokens per query tile,
R = max(BQ * Gp, 16) rows of one tile (Gp = G rounded up to a power of two), BK keys per step,
X context splits (flash-decoding: partial softmaxes merged afterwards).

How the GPU kernel (Triton lowering of pallas_call) is laid out: the grid is (J, K, X), or
(K, J, X) for unsplit decode grids (heads_inner: a tile's kv heads launch side by side, so a
padded bucket's busy programs, the first ones, land on separate SMs); program j finds its
(sequence, query tile) from query_start_loc itself (every sequence's tile count and their
prefix sum, with its bounds and length, from three vector loads; a binary search past
VECTOR_SEARCH_MAX_SEQS sequences), so no XLA kernel runs before the launch, which matters for
small decode steps.
A program loads its R query rows (BQ tokens x the G heads that share kv head k: GQA costs
one read of K/V per group, not per head), walks its causal key range BK keys at a time,
gathering the slots through the block table, and keeps an online softmax (exp2; decode
buckets mask every key step in one loop, other batches only the causal and window edge
steps). With X > 1 each program covers 1/X of the key range and writes a normalised partial
output and its log-sum-exp; a second small kernel (split_merge.py) merges them. This is what
keeps a batch of one or a few long decodes from leaving most SMs idle. Keys per step (BK) also
set how many programs an SM holds at once (their shared memory and registers); default_block_k
takes 64 for decode grids that only then fit in one wave. A decode grid of up to two programs
per SM with most SMs busy is not split but pipelined: 128- or 64-key steps whose K/V Triton
double-buffers (pipelined_decode); one of several waves whose busy programs fill 64-key 3-stage
waves better than 128-key 2-stage ones takes those (many_wave_decode). Both hold for a padded
bucket from tiling_busy_floor busy sequences up, which its caller says (busy_seqs). A decode
grid of fewer programs than SMs is split into one pipelined wave (split_decode_tiling): X from
the grid's size when every slot is busy. In a padded bucket of up to two programs per SM whose
busy count is not said, the grid is 2 or 3 x num_sms() programs and the kernel itself counts the
busy (tile, kv head) items and splits each, in proportion to its key steps, to fill them
(fill_splits: grid (P,), the split counts run-time values that the merge is told through a
small `live` output). The engine also takes that tiling for a full bucket whose contexts are
skewed (skewed_contexts).

Files: reference.py (the jnp reference, validation, the XLA implementation), triton_kernel.py
(the Triton kernel), mgpu.py and mgpu_kernel.py (the Mosaic GPU kernel for prefill-heavy
steps), tuning.py (the per-device tuning table and the `Tiling` value), tiling.py (the rules
from shapes to a tiling), wrapper.py (`ragged_paged_attention`, the one entry point).
"""
