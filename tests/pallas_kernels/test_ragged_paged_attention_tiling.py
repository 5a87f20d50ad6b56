"""Ragged paged attention's tiling rules (ragged_paged_attention/tiling.py) on the shapes they were
measured on (H200 sweeps in BENCHMARKS.md); the kernels they pick are checked against the
reference in test_ragged_paged_attention.py."""

from __future__ import annotations

from jaxserve.pallas_kernels.ragged_paged_attention import tiling as rt


def test_default_tiling_of_decode_batches():
    # (T tokens, S sequences, context) -> (query tile, splits, keys per step) with the wrapper's
    # arguments (the H200 sweeps in BENCHMARKS.md)
    def pick(t, s, ctx, kh=8, g=4, head_dim=128, itemsize=2, num_warps=4, num_stages=2):
        bq = rt.default_block_q(t, s, g)
        x = rt.default_num_splits(t, s, kh, bq, ctx)
        programs = rt.num_tiles(t, s, bq) * kh * x
        return bq, x, rt.default_block_k(bq, g, ctx, x, programs=programs, head_dim=head_dim,
                                          itemsize=itemsize, num_warps=num_warps,
                                          num_stages=num_stages)
    assert pick(1, 1, 1024) == (1, 16, 64)        # a lone decode: 64 keys a split
    assert pick(1, 1, 8192) == (1, 32, 64)
    assert pick(1, 1, 32768) == (1, 32, 128)      # long splits: 128-key steps
    assert pick(16, 16, 1024) == (4, 4, 64)       # 128 programs < 132 SMs: split
    assert pick(32, 32, 1024) == (4, 1, 128)      # 256 programs: no split, no merge
    assert pick(2048, 1, 2048) == (16, 1, 64)     # prefill: query tiles, no split
    # step size by waves: 397-660 programs are one wave of 64-key programs (5 an SM) but more
    # than one of 128-key ones (3 an SM); measured at 512 (64 x 8 and 128 x 4 kv heads), 576,
    # 640, 656 and 672, not at 400
    assert pick(64, 64, 1024) == pick(64, 64, 2048) == (4, 1, 64)
    assert pick(128, 128, 1024, kh=4, g=8) == (2, 1, 64)
    assert pick(50, 50, 1024) == pick(82, 82, 1024) == (4, 1, 64)          # 400, 656 programs
    assert pick(49, 49, 1024) == pick(83, 83, 1024) == (4, 1, 128)         # 392, 664
    assert pick(48, 48, 1024) == pick(96, 96, 1024) == pick(128, 128, 1024) == (4, 1, 128)
    assert pick(4, 4, 32768) == (4, 16, 128)      # 512 programs, but split: not measured
    for other in (dict(head_dim=64), dict(itemsize=4), dict(num_warps=8), dict(num_stages=3)):
        assert pick(64, 64, 1024, **other) == (4, 1, 128)                   # not measured
    assert rt.default_block_k(4, 4, 1024) == 128   # no grid size given: the plain rule
    # exact tile starts: a bucket of decodes launches one program per sequence, not 1.25
    assert rt.num_tiles(32, 32, 4) == 32 and rt.num_tiles(1, 1, 1) == 1
    assert rt.num_tiles(4096, 4096, 4) == 4096 // 4 + 4096 + 1   # binary-search bound


def test_pipelined_decode_of_nearly_full_one_program_per_sm_grids():
    # unsplit decode grids of at most one program per SM with more than 0.78 x 132 busy:
    # 128-key steps
    assert rt.pipelined_decode(16, 16, 32, 8, None) == 128     # 128 programs (Llama-3.1-8B)
    assert rt.pipelined_decode(32, 32, 32, 4, None) == 128     # Qwen3-30B-A3B's heads
    assert rt.pipelined_decode(13, 13, 32, 8, None) == 128     # 104 busy
    assert not rt.pipelined_decode(12, 12, 32, 8, None)    # 96: split over all SMs
    assert not rt.pipelined_decode(16, 16, 32, 8, 12)      # a padded bucket, 12 busy
    assert rt.pipelined_decode(16, 16, 32, 8, 13)
    assert not rt.pipelined_decode(32, 16, 32, 8, None)    # more tokens than slots
    assert rt.pipelined_busy_floor(8) == 13 and rt.pipelined_busy_floor(4) == 26
    assert rt.pipelined_decode(16, 16, 32, 8, rt.pipelined_busy_floor(8))
    assert not rt.pipelined_decode(16, 16, 32, 8, rt.pipelined_busy_floor(8) - 1)
    # only the measured case: E = 128, 2-byte K/V, 16-row query tiles
    assert not rt.pipelined_decode(16, 16, 32, 8, None, head_dim=64)
    assert not rt.pipelined_decode(16, 16, 32, 8, None, itemsize=4)
    assert not rt.pipelined_decode(128, 128, 32, 1, None)      # 32-row tiles (G = 32)


def test_pipelined_decode_of_two_programs_per_sm_grids():
    # 133-264 programs (unsplit by default anyway) with more than 0.78 x 132 busy: 64-key steps
    assert rt.pipelined_decode(17, 17, 32, 8, None) == 64      # 136 programs
    assert rt.pipelined_decode(32, 32, 32, 8, None) == 64      # 256 (Llama-3.1-8B)
    assert rt.pipelined_decode(32, 32, 32, 8, 13) == 64        # a padded bucket, 104 busy
    assert not rt.pipelined_decode(32, 32, 32, 8, 12)          # 96 busy: the default
    assert not rt.pipelined_decode(32, 32, 32, 8, 0)
    assert rt.pipelined_decode(64, 64, 32, 4, 26) == 64        # Qwen3-30B-A3B's heads
    assert not rt.pipelined_decode(64, 64, 32, 4, 25)
    assert rt.pipelined_decode(33, 33, 32, 8, None) == 64      # 264 = 2 x 132
    assert not rt.pipelined_decode(34, 34, 32, 8, None)        # 272: past two an SM
    assert not rt.pipelined_decode(64, 64, 32, 8, None)        # 512: 64-key 2-stage waves
    assert not rt.pipelined_decode(64, 32, 32, 8, None)        # more tokens than slots
    assert not rt.pipelined_decode(12, 32, 32, 8, None)        # 12 tokens: 96 busy at most


def test_split_decode_tiling_of_grids_smaller_than_the_gpu():
    T = rt.DecodeTiling
    def tiling(s, kh=8, busy=None, ctx=8192, t=None, **kw):
        return rt.split_decode_tiling(t or s, s, 32, kh, busy, context=ctx, **kw)
    # every slot busy: num_sms() // programs splits, 128-key steps from 512 keys a split
    assert tiling(1) == T(16, 128, 5)                 # 8 programs x 16 = 128
    assert tiling(1, ctx=4096) == T(16, 64, 5)        # 256 keys a split
    assert tiling(1, ctx=1024) == T(16, 64, 5)
    assert tiling(1, kh=4) == T(32, 64, 5)            # at most 32 splits
    assert tiling(4, ctx=4096) == T(4, 128, 5)
    assert tiling(6, ctx=1024) == T(2, 128, 5)        # 48 programs x 2
    assert tiling(12, ctx=1024) == tiling(16, ctx=1024) == T(1, 128, 5)   # one wave unsplit
    assert tiling(1, ctx=100) == T(1, 128, 5)         # at least 64 keys a split
    assert tiling(1, busy=0) == tiling(1)             # a one-slot bucket is always full
    assert tiling(16, busy=16) == tiling(16)
    # busy count not said (or short of the bucket): fill_splits over 2 x num_sms() programs
    assert tiling(16, busy=0) == tiling(16, busy=15) == T(32, 64, 5, fill_splits=True)
    assert tiling(16, busy=0, ctx=1024) == T(16, 64, 5, fill_splits=True)
    assert tiling(32, kh=4, busy=3) == T(32, 64, 5, fill_splits=True)
    assert tiling(16, busy=0, ctx=64) is None         # one split at most: the default
    # larger grids and the unmeasured cases: other rules
    assert tiling(17) is None and tiling(32) is None
    # ... and up to two programs an SM: fill_splits where the busy count is not said
    assert tiling(32, busy=0) == tiling(17, busy=16) == T(32, 64, 5, fill_splits=True)
    assert tiling(34, busy=0) is None and tiling(64, kh=4, busy=0) == T(32, 64, 5, True)
    assert rt.default_fill_programs(132) == 264 and rt.default_fill_programs(133) == 396
    assert tiling(1, head_dim=64) is None and tiling(1, itemsize=4) is None
    assert tiling(32, t=64) is None                   # more tokens than slots


def test_many_wave_decode_takes_the_tiling_whose_waves_are_fuller():
    # past one wave of 64-key 2-stage steps (660 programs), 64-key 3-stage steps (4 an SM)
    # where their last wave is fuller than 128-key 2-stage steps' (3 an SM)
    assert rt.wave_fill(528, 4) == 1.0 and rt.wave_fill(529, 4) < 0.51
    assert rt.many_wave_decode(128, 128, 32, 8)            # 1,024 programs: 1.94 waves of 528
    assert rt.many_wave_decode(256, 256, 32, 8)            # 2,048
    assert rt.many_wave_decode(256, 256, 32, 4)            # Qwen3-30B-A3B's heads, 1,024
    assert not rt.many_wave_decode(96, 96, 32, 8)          # 768: 1.45 waves against 1.94
    assert not rt.many_wave_decode(64, 64, 32, 8)          # 512: one wave of 64-key 2-stage
    assert not rt.many_wave_decode(32, 32, 32, 8)
    assert not rt.many_wave_decode(256, 128, 32, 8)        # more tokens than slots
    assert not rt.many_wave_decode(128, 128, 32, 8, head_dim=64)     # only the measured case
    assert not rt.many_wave_decode(128, 128, 32, 8, itemsize=4)
    # a padded bucket: the busy programs (launched first) set the waves
    assert rt.many_wave_decode(128, 128, 32, 8, 65)        # 520 programs: one wave of 528
    assert not rt.many_wave_decode(128, 128, 32, 8, 80)    # 640: 1.21 waves against 1.62
    assert rt.many_wave_decode(128, 128, 32, 8, 112)
    assert not rt.many_wave_decode(128, 128, 32, 8, 0)     # not said: the default


def test_tiling_busy_floor_is_where_a_padded_bucket_tiles_as_a_full_one():
    # from the floor up (and only there) a bucket takes its full tiling, with busy_seqs = floor
    def floor(s, kh):
        return rt.tiling_busy_floor(s, s, 32, kh)
    assert floor(16, 8) == floor(32, 8) == rt.pipelined_busy_floor(8) == 13
    assert floor(32, 4) == floor(64, 4) == rt.pipelined_busy_floor(4) == 26
    assert floor(64, 8) == floor(128, 4) == floor(1, 8) == 0    # 512 programs; a lone decode
    assert floor(128, 8) == 100 and floor(256, 8) == 248 and floor(256, 4) == 199
    for s, kh in ((128, 8), (256, 8), (256, 4), (32, 8)):
        f = floor(s, kh)
        full = bool(rt.pipelined_decode(s, s, 32, kh, None)) or rt.many_wave_decode(s, s, 32, kh)
        assert full
        for busy in range(f, s + 1):
            assert bool(rt.pipelined_decode(s, s, 32, kh, busy)) or \
                rt.many_wave_decode(s, s, 32, kh, busy)
        assert not (rt.pipelined_decode(s, s, 32, kh, f - 1) or
                    rt.many_wave_decode(s, s, 32, kh, f - 1))
    assert rt.tiling_busy_floor(128, 128, 32, 8, head_dim=64) == 0   # not the measured case
