"""The rest of the Mosaic GPU attention kernel's interpret-mode sweep: the cases that
tests/pallas_kernels/test_ragged_paged_attention_mgpu.py leaves out of the CPU suite (it keeps
one or two of each test's cases, every branch and edge case at least once; each case there
compiles its own interpreted program, seconds on 2 CPU cores). The same checks against the
reference, in interpret mode; here on the GPU machine, where the compile is faster."""

from __future__ import annotations

import pytest

import test_ragged_paged_attention_mgpu as cpu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,kh,tiling", cpu.PREFILL_GQA_GPU)
def test_prefill_gqa(n, kh, tiling):
    cpu.test_prefill_gqa(n, kh, tiling)


def test_chunked_prefill_odd_lengths_three_stages_sequence_tiling():
    cpu.test_chunked_prefill_odd_lengths_three_stages("sequence")


def test_mixed_with_decode_rows_and_padding_sequences_flat_tiling():
    cpu.test_mixed_with_decode_rows_and_padding_sequences("flat")


def test_decode_rows_one_warpgroup_no_splits():
    cpu.test_decode_rows_one_warpgroup_and_splits(1)


def test_splits_with_prefill_chunks_at_gqa_1():
    cpu.test_splits_with_prefill_chunks_and_two_warpgroups(4, 4)


@pytest.mark.parametrize("seed", cpu.TILE_MAP_SEEDS_GPU)
def test_tile_map_lists_every_tile_in_order_within_the_grid_bound(seed):
    cpu.test_tile_map_lists_every_tile_in_order_within_the_grid_bound(seed)


@pytest.mark.parametrize("tiling,q_buffers", [("sequence", 1), ("flat", 2)])
def test_few_ctas_each_loop_over_several_work_items(tiling, q_buffers):
    cpu.test_few_ctas_each_loop_over_several_work_items(tiling, q_buffers)


def test_ctas_without_a_work_item_store_nothing_flat_tiling():
    cpu.test_ctas_without_a_work_item_store_nothing("flat")


@pytest.mark.parametrize("bt_ahead,n,kh", cpu.BT_AHEAD_GPU)
def test_block_table_entries_loaded_ahead_over_many_key_steps(bt_ahead, n, kh):
    cpu.test_block_table_entries_loaded_ahead_over_many_key_steps(bt_ahead, n, kh)
