"""`cb-kernels serve`: an OpenAI-compatible HTTP server on the Engine (needs the `serve` extra:
`pip install "cb_kernels[serve]"`: FastAPI, uvicorn, prometheus_client, pydantic).

    protocol.py       request schemas (pydantic), their SamplingParams, OpenAI's error body,
                      pydantic's and the engine's refusals rewritten to name the field
    prompts.py        a request's prompts as token ids (tokenizer, chat template)
    openai_format.py  OpenAI's response bodies, SSE chunks, logprobs and usage
    engine_loop.py    EngineLoop: the one thread that owns the Engine; tickets in, outputs out
    metrics.py        Prometheus metrics (cb_kernels_*)
    routes.py         the FastAPI app: /health, /metrics, /v1/models, /v1/completions,
                      /v1/chat/completions (SSE streaming)
    server.py         the command line: load the model, build the engine, run uvicorn, SIGTERM
"""
