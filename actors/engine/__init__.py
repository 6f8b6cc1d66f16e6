"""The engine core: synchronous code on the MLX thread (requests, the schedule, the forward
pass, the prefix block table, output). Knows MLX and mlx-lm; no actors, no HTTP."""
