"""`python -m mlx_engine serve`: an OpenAI-compatible HTTP server with speculative decoding.

    schemas.py   the request bodies (pydantic): every field checked, null = default, unsupported ones refused
    errors.py    every error in OpenAI's shape (APIError, the handlers for 404 / 405 / a bug)
    intake.py    what a request passes before it is queued: API key, body size, JSON, schema, tokens
    stream.py    token ids -> the text a client reads, cut at stop strings
    jobs.py      one request on its way through the engine thread (events handed over a queue)
    worker.py    the engine thread: admission, failures, counts; a fair queue over one Engine (any model)
    batch.py     the engine thread: continuous batching over core.batch_engine.BatchEngine (KV, window, hybrid)
    progress.py  prompts being prefilled: /health, /metrics and a log line per long one
    metrics.py   GET /metrics (prometheus_client)
    app.py       the FastAPI routes, SSE streaming, disconnects
    main.py      the `serve` command: flags, loading, uvicorn (graceful shutdown)
    load.py      `python -m mlx_engine.serve.load`: concurrent streaming clients, requests/s and tok/s

One engine thread owns the model and every MLX array; the HTTP side (the event loop) only tokenizes,
queues requests and reads plain Python events back.
"""
