"""`cb-kernels serve`: an OpenAI-compatible HTTP server on the Engine (needs the `serve` extra:
`pip install "cb_kernels[serve]"`: FastAPI, uvicorn, prometheus_client, pydantic).

    protocol.py     request schemas (pydantic), their SamplingParams, OpenAI's error body
    engine_loop.py  EngineLoop: the one thread that owns the Engine; tickets in, outputs out
    metrics.py      Prometheus metrics (cb_kernels_*)
    app.py          the FastAPI app: /health, /v1/models, /v1/completions, /v1/chat/completions,
                    /metrics, SSE streaming
    server.py       the command line: load the model, build the engine, run uvicorn, SIGTERM
"""
