"""jaxserve.server: the OpenAI-compatible HTTP server.

app.py                  build_app(ctx) -> FastAPI; run_server(args) for `jaxserve serve`
context.py              ServerContext: engine, served names, API keys, limits, tokenizer thread
protocol.py             request bodies (pydantic, strict)
inputs.py               bodies -> prompt token ids + SamplingParams (all 400s named here)
unsupported.py          fields asking for a feature the engine lacks -> 400 (one table)
serving_completions.py  POST /v1/completions
serving_chat.py         POST /v1/chat/completions
serving.py              run the prompts; answer whole or as a stream
generation.py           engine requests of one HTTP request; disconnect -> abort
streaming.py            cumulative outputs -> SSE chunks
logprobs.py             engine logprobs in OpenAI's completions and chat shapes
errors.py               OpenAI error bodies and statuses
auth.py                 API keys (constant-time)
openapi.py              /docs and /openapi.json with the request bodies' schemas
background.py           BackgroundServer: the app in a thread on a free port (tests, notebooks)
"""
