"""Run by tests/test_distributed.py in subprocesses (fake CPU devices are per process).

    distributed_check.py host RANK PORT MODEL_DIR [lose-worker]
        one of two hosts (2 fake devices each) of a TP=4 engine; rank 0 prints the tokens
        (lose-worker: rank 0 prints "ready", waits for a line on stdin, then generates and
        prints the error that the worker's loss raised)
    distributed_check.py single MODEL_DIR
        one process of 4 fake devices: the tokens of TP=4 and of no mesh
"""

import json
import os
import sys

ENGINE = dict(load_format="dummy", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=64, warmup=False)
PROMPTS = [[3, 17, 42, 9, 100][:n] for n in (2, 5)] + [[7] * 11]


def generate(llm):
    from jaxserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def host(rank: int, port: int, model: str, lose_worker: bool) -> int:
    from jaxserve.engine import distributed

    distributed.initialize(distributed.DistributedConfig(2, rank, "127.0.0.1", port))
    kwargs = dict(ENGINE, tensor_parallel_size=4)
    if rank:
        from jaxserve.engine import builder
        return distributed.worker_main(builder.from_engine_args(**dict(kwargs, model=model)))
    from jaxserve import LLM
    from jaxserve.worker.step_channel import WorkerLostError

    llm = LLM(model, **kwargs)
    if not lose_worker:
        print(json.dumps(generate(llm)), flush=True)
        return 0
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        generate(llm)
    except WorkerLostError as e:
        print(f"lost: {e}", flush=True)
        os._exit(3)       # NOTE: jax.distributed's exit barrier would wait for the dead worker
    return 1


def single(model: str) -> int:
    from jaxserve import LLM

    print(json.dumps({tp: generate(LLM(model, **ENGINE, tensor_parallel_size=tp)) for tp in (4, 1)}))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "host":
        sys.exit(host(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:] == ["lose-worker"]))
    sys.exit(single(sys.argv[2]))
