"""Session 11 run 5: `jaxserve bench latency` with this session's decode tiling ("new") or with
the previous one ("old": three key loops, no two-an-SM pipelining), same machine."""
import functools, sys
if sys.argv[1] == "old":
    from jaxserve.pallas_kernels import ragged_paged_attention as rpa
    new_rule = rpa.pipelined_decode
    rpa.pipelined_decode = lambda *a, **k: (lambda r: 0 if r == 64 else r)(new_rule(*a, **k))
    rpa.ragged_paged_attention = functools.partial(rpa.ragged_paged_attention,
                                                   mask_all_steps=False)
from jaxserve.cli import main
sys.exit(main(sys.argv[2:]))
