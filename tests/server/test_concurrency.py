"""Many clients at once, and clients that leave: every request ends, nothing is left behind."""

from __future__ import annotations

import asyncio

import httpx


def test_32_concurrent_streaming_clients_all_finish(served):
    async def one(client, i: int) -> tuple[str, str | None]:
        text, finish = "", None
        stream = await client.completions.create(model=served.model, prompt=f"Fact number {i}:", max_tokens=4,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def main():
        async with served.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert all(finish == "length" and text for text, finish in results), results
    m = served.wait_idle()
    assert m["jaxserve:num_requests_running"] == 0


def test_disconnecting_clients_leave_no_request_and_no_block(served):
    aborted_before = served.metrics().get("jaxserve:request_abort_total", 0.0)
    long = dict(model=served.model, prompt="Write a very long story:", max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True})

    async def quit_stream(client) -> int:
        stream = await client.completions.create(stream=True, **long)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()      # drops the connection mid-stream
        return seen

    async def quit_whole() -> None:
        # A non-streamed request whose client gives up waiting: the server must notice. (The
        # wait is long enough for the request to be in the engine by then.)
        async with httpx.AsyncClient(timeout=4.0) as http:
            try:
                await http.post(served.url + "/v1/completions", json={
                    "prompt": "Another long story:", "max_tokens": 400, "ignore_eos": True})
            except httpx.TimeoutException:
                return
        raise AssertionError("a 400-token answer should not have come back within 4 s")

    async def main():
        async with served.async_client() as client:
            seen = await asyncio.gather(*(quit_stream(client) for _ in range(8)), quit_whole())
        return seen[:8]

    assert asyncio.run(main()) == [2] * 8
    m = served.wait_idle()
    assert m["jaxserve:num_requests_running"] == 0
    assert m["jaxserve:num_requests_waiting"] == 0
    assert m["jaxserve:num_used_blocks"] == 0
    assert m["jaxserve:kv_cache_usage_perc"] == 0
    assert m["jaxserve:request_abort_total"] - aborted_before == 9
    # ...and the server still answers.
    out = served.client().completions.create(model=served.model, prompt="Hi", max_tokens=1)
    assert out.choices[0].finish_reason == "length"
