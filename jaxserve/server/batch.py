"""`jaxserve generate`: an OpenAI batch file in, one result line per request line out.

Input (JSONL), one request per line, as for OpenAI's Batch API and vLLM's run-batch:

    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per non-blank input line, in input order, in vLLM's run-batch shape:

    {"id": "batch_req_...", "custom_id": "a", "error": null,
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": <the API's response>}}

A line that cannot run (malformed JSON, unknown url, invalid body, ...) gets
`"response": {"status_code": 400, "request_id": ..., "body": null}` and `"error"` set to the
OpenAI error object (`message`, `type`, `param`, `code`); the other lines still run.

The bodies go through the HTTP server's own code (jaxserve.server: the same validation,
sampling parameters and response bodies as `jaxserve serve`), and every request is in the
engine at once, so they are batched together as the server would batch concurrent clients.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pydantic

from jaxserve.server.errors import APIError, bad_request, from_validation_error
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
SUPPORTED_URLS = (COMPLETIONS_URL, CHAT_URL)


@dataclass(frozen=True)
class BatchLine:
    index: int                          # position among the non-blank input lines
    custom_id: str | None               # None only when the line is not even a JSON object
    url: str | None
    body: Any                           # the request body, still unvalidated
    error: APIError | None = None       # why the line cannot run at all
    line_number: int = 0                # in the input file, from 1 (blank lines count)


def parse_line(index: int, text: str, line_number: int | None = None) -> BatchLine:
    """The envelope of one input line; problems become `error`, never an exception. Messages
    name the input file's line number (not positions inside the line's JSON)."""
    n = index + 1 if line_number is None else line_number

    def fail(custom_id, url, body, message: str, **kwargs) -> BatchLine:
        return BatchLine(index, custom_id, url, body, bad_request(f"line {n}: {message}", **kwargs), n)

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return fail(None, None, None, f"not valid JSON ({e.msg}, at column {e.colno})", code="invalid_json")
    if not isinstance(obj, dict):
        return fail(None, None, None, f"must be a JSON object with custom_id, method, url and body; "
                                      f"got {type(obj).__name__}")
    custom_id, url, body = obj.get("custom_id"), obj.get("url"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return fail(None, url, body, "custom_id must be a non-empty string", param="custom_id")
    if obj.get("method", "POST") != "POST":
        return fail(custom_id, url, body, f"method must be 'POST'; got {obj.get('method')!r}", param="method")
    if url not in SUPPORTED_URLS:
        return fail(custom_id, url, body, f"url must be one of {', '.join(SUPPORTED_URLS)}; got {url!r}",
                    param="url")
    if not isinstance(body, dict):
        return fail(custom_id, url, body, f"body must be a JSON object (the request body for {url})",
                    param="body")
    return BatchLine(index, custom_id, url, body, line_number=n)


class _NoClient:
    """Stands in for the HTTP request the server's routes watch for a disconnect: a batch
    line's client never goes away."""

    async def receive(self) -> dict:
        await asyncio.get_running_loop().create_future()   # never resolves; cancelled at the end
        raise AssertionError("unreachable")


def _output_line(line: BatchLine, status: int, request_id: str, body: dict | None,
                 error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": error}


def error_line(line: BatchLine, err: APIError) -> dict:
    return _output_line(line, err.status, f"batch-{uuid.uuid4().hex}", None, err.body()["error"])


async def run_line(ctx, line: BatchLine) -> dict:
    """One batch line through the server's completions / chat code -> its output line."""
    from jaxserve.server.serving_chat import create_chat_completion
    from jaxserve.server.serving_completions import create_completion

    if line.error is not None:
        return error_line(line, line.error)
    model, route = ((ChatCompletionRequest, create_chat_completion) if line.url == CHAT_URL
                    else (CompletionRequest, create_completion))
    try:
        try:
            # Through JSON, exactly as the server parses a body (strict types, no NaN).
            req = model.model_validate_json(json.dumps(line.body))
        except pydantic.ValidationError as e:
            raise from_validation_error(e) from None
        if req.stream:
            raise bad_request("stream must be false in a batch file: each line gets one whole "
                              "response", param="stream")
        response = await route(ctx, _NoClient(), req)
        body = json.loads(response.body)
        return _output_line(line, response.status_code, body.get("id", ""), body, None)
    except APIError as e:
        return error_line(line, e)
    except Exception as e:  # noqa: BLE001 - one line failing must not sink the batch
        return error_line(line, APIError(500, f"the request failed: {type(e).__name__}: {e}",
                                         code="internal_error"))


async def run_batch(ctx, lines: Iterable[str], write: Callable[[dict], None], *,
                    max_in_flight: int, on_done: Callable[[BatchLine, dict], None] = lambda line, out: None
                    ) -> None:
    """Run every non-blank line (at most `max_in_flight` at once) and `write` the output
    lines in input order, each as soon as all lines before it are written."""
    limit = asyncio.Semaphore(max_in_flight)
    done: dict[int, dict] = {}
    next_to_write = 0

    async def one(line: BatchLine) -> None:
        nonlocal next_to_write
        try:
            done[line.index] = out = await run_line(ctx, line)
        finally:
            limit.release()
        on_done(line, out)
        while next_to_write in done:
            write(done.pop(next_to_write))
            next_to_write += 1

    tasks = []
    index = 0
    for line_number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        await limit.acquire()
        tasks.append(asyncio.create_task(one(parse_line(index, text, line_number))))
        index += 1
    await asyncio.gather(*tasks)


def _count_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for text in f if text.strip())


class BatchProgress:
    """A bar on a terminal; elsewhere (a log file, CI) a line every `every` requests or every
    `seconds`, whichever comes first. Then a summary, with the first failures by input line
    number."""

    SHOWN_ERRORS = 5

    def __init__(self, total: int, every: int, stream=None, seconds: float = 10.0):
        from tqdm import tqdm      # NOTE: not tqdm.auto: no notebook widget from a CLI

        self.stream = stream or sys.stderr
        self.total, self.every = total, every
        self.count = self.failed = 0
        self.errors: list[str] = []
        self.t0 = self.last_line = time.perf_counter()
        self.seconds = seconds
        self.bar = tqdm(total=total, unit="req", desc="Running batch", file=self.stream) \
            if self.stream.isatty() else None

    def update(self, line: BatchLine, out: dict) -> None:
        self.count += 1
        if out["error"] is not None:
            self.failed += 1
            if len(self.errors) < self.SHOWN_ERRORS:
                message = out["error"]["message"]
                prefix = f"line {line.line_number}: "
                self.errors.append(message if message.startswith(prefix) else prefix + message)
        if self.bar is not None:
            self.bar.update(1)
        elif self.count < self.total and (
                (self.every and self.count % self.every == 0)
                or time.perf_counter() - self.last_line >= self.seconds):
            self.last_line = time.perf_counter()
            self._print(f"{self.count}/{self.total} requests done ({self.failed} failed), "
                        f"{time.perf_counter() - self.t0:.1f} s")

    def close(self, output: str) -> None:
        if self.bar is not None:
            self.bar.close()
        self._print(f"{self.count} requests in {time.perf_counter() - self.t0:.1f} s: "
                    f"{self.count - self.failed} succeeded, {self.failed} failed; results in {output}")
        for message in self.errors:
            self._print(f"  failed: {message}")
        if self.failed > len(self.errors):
            self._print(f"  ... and {self.failed - len(self.errors)} more (see `error` in the output)")

    def _print(self, text: str) -> None:
        print(f"jaxserve batch: {text}", file=self.stream, flush=True)


def run_batch_file(args) -> int:
    """`jaxserve generate` / `run-batch`: args carry the engine and frontend flags, input,
    output and progress_every. Returns 0 when every line was answered (errors included),
    1 when the files cannot be used."""
    from jaxserve.server.startup import server_context, start_engine

    try:
        total = _count_lines(args.input)
        out_file = open(args.output, "w", encoding="utf-8")
    except OSError as e:
        print(f"jaxserve {getattr(args, 'command', 'generate')}: error: {e}", file=sys.stderr)
        return 1
    engine = ctx = None
    try:
        engine, default_sampling = start_engine(args)
        ctx = server_context(engine, args, default_sampling)
        # NOTE: twice the running batch keeps the engine full while the next lines are
        # tokenized, without queueing a huge file's worth of requests at once.
        max_in_flight = 2 * engine.config.scheduler.max_num_seqs
        progress = BatchProgress(total, getattr(args, "progress_every", 100))

        def write(obj: dict) -> None:
            out_file.write(json.dumps(obj, ensure_ascii=False) + "\n")
            out_file.flush()

        with open(args.input, encoding="utf-8") as in_file:
            asyncio.run(run_batch(ctx, in_file, write, max_in_flight=max_in_flight,
                                  on_done=progress.update))
        progress.close(args.output)
    finally:
        out_file.close()
        if ctx is not None:
            ctx.tokenizer_pool.shutdown(wait=False)
        if engine is not None:
            engine.shutdown()
    return 0
