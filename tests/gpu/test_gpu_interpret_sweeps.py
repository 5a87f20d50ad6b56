"""The rest of the interpret-mode kernel sweeps whose CPU tests keep one or two cases each
(every branch and edge case at least once; each case compiles its own interpreted kernel,
seconds on 2 CPU cores): the Triton ragged paged attention, the chunked gated-delta kernel and
moe_decode. The same test bodies against the same references, on the GPU machine."""

from __future__ import annotations

import pytest

import test_gated_delta_chunked as gdc
import test_moe_decode as moe
import test_ragged_paged_attention as rpa

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,kh", rpa.DECODE_GQA_GPU)
def test_decode_only_gqa(n, kh):
    rpa.test_decode_only_gqa(n, kh)


@pytest.mark.parametrize("n,kh", rpa.ONE_TOKEN_GQA_GPU)
def test_one_token_tiles(n, kh):
    rpa.test_one_token_tiles(n, kh)


@pytest.mark.parametrize("heavy_first,prefetch_slots", rpa.TILE_ORDER_GPU)
def test_tile_order_and_prefetched_slots(heavy_first, prefetch_slots):
    rpa.test_tile_order_and_prefetched_slots(heavy_first, prefetch_slots)


@pytest.mark.parametrize("num_splits", rpa.HEADS_INNER_SPLITS_GPU)
def test_kv_heads_inner_launch_order_changes_no_output(num_splits):
    rpa.test_kv_heads_inner_launch_order_changes_no_output(num_splits)


@pytest.mark.parametrize("qlens, starts, slots", gdc.CASES_GPU)
def test_chunked_gated_delta_matches_recurrence(qlens, starts, slots):
    gdc.test_chunked_kernel_matches_recurrence(qlens, starts, slots)


@pytest.mark.parametrize("t,k,x,d,f", moe.SHAPES_GPU)
def test_moe_decode_matches_reference_and_the_grouped_path(t, k, x, d, f):
    moe.test_matches_reference_and_the_grouped_path(t, k, x, d, f)


@pytest.mark.parametrize("case", moe.FP8_GPU)
def test_moe_decode_fp8_matches_reference_and_the_grouped_path(case):
    moe.test_fp8_matches_reference_and_the_grouped_path(case)
