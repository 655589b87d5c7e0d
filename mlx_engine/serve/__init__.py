"""`python -m mlx_engine serve`: an OpenAI-compatible HTTP server with speculative decoding.

    schemas.py   the request bodies (pydantic) and their sampling settings
    stream.py    token ids -> the text a client reads, cut at stop strings
    jobs.py      one request on its way through the engine thread (events handed over a queue)
    worker.py    the engine thread: a fair queue over one Engine (any model, any drafter)
    batch.py     the engine thread: continuous batching over core.batch_engine.BatchEngine (KV-cache models)
    app.py       the FastAPI routes, SSE streaming, OpenAI's error shape
    main.py      the `serve` command: flags, loading, uvicorn
    load.py      `python -m mlx_engine.serve.load`: concurrent streaming clients, requests/s and tok/s

One engine thread owns the model and every MLX array; the HTTP side (the event loop) only tokenizes,
queues requests and reads plain Python events back.
"""
