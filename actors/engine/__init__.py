"""The engine core: synchronous code on the MLX thread (requests, the schedule, the forward
pass, the prefix block table), and the text stage its output goes through (``text.py``, no
MLX, run beside it when serving). Knows MLX and mlx-lm; no actors, no HTTP."""
