"""Run by tests/test_data_parallel.py in a subprocess of 2 fake CPU devices: data_parallel_size=2
(one engine per device) against one engine; prints "ok ..." per check."""

import os

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.engine.data_parallel import DataParallelEngine

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "ckpt", "llama")
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              warmup=False, num_kv_blocks=32)
PROMPTS = [{"prompt_token_ids": p} for p in ([3, 17], [3, 17, 42, 9, 100], [7] * 11, [5, 6, 7])]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

assert len(jax.devices()) == 2
one = [o.outputs[0].token_ids for o in LLM(GOLDEN, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)]
llm = LLM(GOLDEN, data_parallel_size=2, **ENGINE)
dp = llm.engine
assert isinstance(dp, DataParallelEngine) and len(dp.replicas) == 2
# each replica's weights and cache live on its own device
assert [r.runner.kv_cache[0]["k"].devices() for r in dp.replicas] == [{d} for d in jax.devices()], \
    [r.runner.kv_cache[0]["k"].devices() for r in dp.replicas]
outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
assert [o.outputs[0].token_ids for o in outs] == one, ([o.outputs[0].token_ids for o in outs], one)
assert [o.request_id for o in outs] == [str(i) for i in range(len(PROMPTS))]    # input order
steps = [r.num_steps for r in dp.replicas]
assert all(steps), steps
print("ok tokens equal one engine, in input order; both replicas stepped", steps)

metrics = llm.get_metrics()
assert metrics["request_success_total"] == len(PROMPTS), metrics
assert metrics["generation_tokens_total"] == 6 * len(PROMPTS), metrics
from prometheus_client import generate_latest  # noqa: E402 - the server's /metrics text

text = generate_latest(dp.metrics.registry).decode()
assert f"jaxserve:request_success_total {float(len(PROMPTS))}" in text, text
print("ok metrics summed")

# routing: fewest unfinished requests, ties round robin
long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
for rid in "abc":
    dp.add_request(rid, [3, 17, 42], long)
assert [dp._owner[r] for r in "abc"] == [0, 1, 0] or [dp._owner[r] for r in "abc"] == [1, 0, 1]
assert [dp.load(i) for i in (0, 1)] in ([2, 1], [1, 2])
dp.step()
dp.step()
target = dp._owner["b"]
other = 1 - target
used = [r.scheduler.pool.num_used for r in dp.replicas]
assert used[target] > 0
assert dp.abort_request("b")
after = [r.scheduler.pool.num_used for r in dp.replicas]
assert after[target] < used[target] and after[other] == used[other], (used, after)
assert not dp.abort_request("b")
print("ok abort frees blocks on its own replica", used, after)
dp.add_request("d", [1, 2], long)
assert dp._owner["d"] == target     # now the less loaded one
while dp.has_unfinished_requests():
    dp.step()
print("ok routed to the least loaded replica")
dp.core.drain()          # what AsyncEngine does at stop: every replica's core
