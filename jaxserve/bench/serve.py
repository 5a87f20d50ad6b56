"""`jaxserve bench serve`: an async load generator for any OpenAI-compatible server.

Streams `/v1/completions` requests at a Poisson request rate, optionally capped at a number
of requests in flight, and sweeps over every (rate, concurrency) pair given. Per request it
records the time to first token (TTFT), the gaps between streamed chunks (ITL), the time per
output token after the first (TPOT) and the end-to-end latency; it reports means, p50 and p99,
throughput, and goodput: requests per second that met every `--goodput` SLO.

Prompts go as token ids by default (any server accepting them works, also one without a
tokenizer); output lengths are enforced with `ignore_eos` (a vLLM extension jaxserve has).
A chunk counts as a token event whether or not it carries text; token counts come from the
final `usage` chunk (`stream_options.include_usage`) when the server sends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from jaxserve.bench import report
from jaxserve.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int                      # tokens asked for
    success: bool = False
    output_tokens: int = 0               # tokens received (usage, else chunks)
    ttft: float = math.nan               # seconds
    e2el: float = math.nan
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 0.2, "tpot": 0.05} (milliseconds in, seconds out)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not sep:
            raise SystemExit(f"--goodput takes NAME:MILLISECONDS with NAME in ttft, tpot, e2el; got {item!r}")
        try:
            slos[name] = float(value) / 1e3
        except ValueError:
            raise SystemExit(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return slos


async def send_one(session, url: str, payload: dict, headers: dict, result: RequestResult) -> RequestResult:
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"])[:300]
                    return result
                if obj.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                usage = obj.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens", 0))
    except Exception as e:  # a refused connection or a broken stream fails this request only
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2el = time.perf_counter() - t0
    result.output_tokens = result.output_tokens or chunks
    result.success = last is not None
    if not result.success:
        result.error = "the stream ended without any choice chunk"
    return result


async def run_load(base_url: str, model: str, requests: list[BenchRequest], *, request_rate: float,
                   max_concurrency: int | None, api_key: str | None = None, use_text: bool = False,
                   seed: int = 0, use_tqdm: bool = True, endpoint: str = "/v1/completions",
                   ) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at `request_rate`/s; inf = all at once). Returns
    (results in request order, seconds from the first send to the last completion)."""
    import aiohttp

    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(requests), desc=f"rate {request_rate}, concurrency {max_concurrency}",
                   dynamic_ncols=True)

    async def one(session, r: BenchRequest) -> RequestResult:
        payload = {"model": model, "prompt": r.prompt if use_text and r.prompt else r.prompt_token_ids,
                   "max_tokens": r.output_len, "stream": True, "ignore_eos": True, "temperature": 0.0,
                   "stream_options": {"include_usage": True}}
        result = RequestResult(prompt_len=r.prompt_len, output_len=r.output_len)
        if gate is None:
            await send_one(session, url, payload, headers, result)
        else:
            async with gate:
                await send_one(session, url, payload, headers, result)
        if bar is not None:
            bar.update(1)
        return result

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)        # the semaphore (if any) is the only cap
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = []
        t0 = time.perf_counter()
        for r in requests:
            tasks.append(asyncio.create_task(one(session, r)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.success]
    ms = lambda xs, q: 1e3 * report.percentile(xs, q)  # noqa: E731
    mean_ms = lambda xs: 1e3 * statistics.mean(xs) if xs else math.nan  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [r.tpot for r in ok if not math.isnan(r.tpot)]
    itl = [x for r in ok for x in r.itl]
    e2el = [r.e2el for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if all(getattr(r, name) <= limit for name, limit in slos.items()
                                 if not math.isnan(getattr(r, name)))]
    errors = sorted({r.error for r in results if not r.success})
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "requests_per_s": len(ok) / duration, "output_tok_per_s": out_tokens / duration,
            "total_tok_per_s": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
            "goodput_req_per_s": len(good) / duration if slos else math.nan,
            "ttft_mean_ms": mean_ms(ttft), "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "tpot_mean_ms": mean_ms(tpot), "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
            "e2el_p50_ms": ms(e2el, 50), "e2el_p99_ms": ms(e2el, 99),
            "errors": errors[:5]}


async def wait_for_server(base_url: str, timeout_s: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(base_url.rstrip("/") + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"no healthy server at {base_url} after {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


async def first_model(base_url: str, api_key: str | None) -> str:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            body = await resp.json()
    try:
        return body["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise SystemExit(f"{base_url}/v1/models listed no model; pass --model") from None


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.bench.throughput import add_dataset_arguments

    p = argparse.ArgumentParser(prog="jaxserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to ask for (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="Poisson arrival rates to sweep, requests/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[0],
                   help="caps on requests in flight to sweep (0: no cap)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:100 tpot:50 (milliseconds)")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="random prompts draw token ids below this (keep it <= the served vocabulary)")
    p.add_argument("--text-prompts", action="store_true",
                   help="send ShareGPT prompts as text instead of token ids")
    p.add_argument("--wait-for-server", type=float, default=0.0,
                   help="poll /health for up to this many seconds before starting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_dataset_arguments(p)
    # vLLM's `vllm bench serve` names for the random dataset's lengths (same destinations).
    g = p.add_argument_group("vLLM's names")
    g.add_argument("--random-input-len", dest="input_len", type=int, default=argparse.SUPPRESS,
                   help="the same as --input-len")
    g.add_argument("--random-output-len", dest="output_len", type=int, default=argparse.SUPPRESS,
                   help="the same as --output-len")
    return p


def main(argv: list[str]) -> int:
    from jaxserve.bench.throughput import make_requests

    args = build_parser().parse_args(argv)
    slos = parse_goodput(args.goodput)
    if args.wait_for_server:
        t0 = time.perf_counter()
        asyncio.run(wait_for_server(args.base_url, args.wait_for_server))
        print(f"server healthy after {time.perf_counter() - t0:.1f} s of waiting")
    model = args.model or asyncio.run(first_model(args.base_url, args.api_key))
    tokenizer = None
    if args.dataset_name == "sharegpt":
        from jaxserve.bench.throughput import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer)
    requests = make_requests(args, args.vocab_size, tokenizer)
    rows = []
    for rate in args.request_rate:
        for conc in args.max_concurrency:
            results, duration = asyncio.run(run_load(
                args.base_url, model, requests, request_rate=rate, max_concurrency=conc or None,
                api_key=args.api_key, use_text=args.text_prompts, seed=args.seed,
                use_tqdm=not args.disable_tqdm))
            rows.append({"request_rate": rate, "max_concurrency": conc or None,
                         **summarize(results, duration, slos)})
    result = {"benchmark": "serve", "environment": report.environment(), "base_url": args.base_url,
              "model": model, "slos_s": slos,
              "dataset": {"name": args.dataset_name, "path": args.dataset_path, "num_prompts": len(requests)},
              "results": rows}
    report.print_table("serve", rows, ["request_rate", "max_concurrency", "completed", "failed",
                                       "requests_per_s", "output_tok_per_s", "goodput_req_per_s",
                                       "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                       "itl_p50_ms", "itl_p99_ms"])
    for r in rows:
        if r["errors"]:
            print(f"errors at rate {r['request_rate']}, concurrency {r['max_concurrency']}: {r['errors']}")
    report.write_json(args.output_json, result)
    return 0
