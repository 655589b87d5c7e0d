"""`python -m mlx_engine.bench`: speculative decoding against plain decoding and against mlx-lm."""
