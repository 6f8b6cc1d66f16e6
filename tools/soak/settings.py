"""The soak's settings: the server's limits (small, so that a short run reaches each of
them), the traffic's pace, how long faults are probed, the leak bounds."""

from __future__ import annotations

DEFAULT_MINUTES = 10.0
# The server's limits: small, so that a short run reaches each of them.
MAX_QUEUE = 64  # a burst of 256 overflows it; the load's 64 clients fit
IDLE_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
MAX_BODY_BYTES = 256 * 1024
SHUTDOWN_GRACE_S = 3.0
# The longest answer the soak asks for (sigterm's stories); a huge max_tokens is cut to it.
MAX_TOKENS_LIMIT = 256
# About 8 blocks of the default model (64 tokens, ~2.9 MB each): most prefix hits come from
# disk, where corrupt blocks can be served if anything is wrong.
CACHE_RAM_MAX = 24 * 10**6
# A disk smaller than the cache's quota (the case ENOSPC comes from): with a quota below the
# disk's size, the index evicts before each write once at its quota, so a write never finds
# the disk full. The tmpfs holds what a long run writes before disk_full fills it (about 20
# blocks a minute here), and disk_deleted empties it for the phases after.
CACHE_DISK_MAX = 2**30
TMPFS_BYTES = 256 * 2**20

MAX_CONCURRENCY = 64
CONCURRENCY_LEVELS = (1, 8, 32, MAX_CONCURRENCY, 16, 4, 48, 2)
BURST = 256
REQUEST_TIMEOUT_S = 180.0
STARTUP_TIMEOUT_S = 600.0  # the first start may convert the default model
CORPUS_EVERY_S = 0.5
CORPUS_IN_FLIGHT = 4
# The answers per second the server keeps up (paces how much work a phase starts): a
# moving average, and its floor.
CAPACITY_EWMA = 0.2
MIN_RATE = 0.2
# How long probes look for a fault's effect on the SSD writer (or half the phase, if longer).
FAULT_WINDOW_S = 30.0
SLOW_READ_S = 0.2
SLOW_BODY_PIECES, SLOW_BODY_PAUSE_S = 3, 0.3  # 0.9 s in all: well inside the body timeout
MIN_PHASE_S = 5.0
# What a crash leaves in the server's log: a traceback, a fatal error, a C++ abort at exit.
CRASH_MARKS = ("Traceback (most recent call last)", "Fatal Python error", "terminate called")
# Leak bounds over the warm baseline (Soak.check_resources says why these).
RSS_SLACK = 0.5
FD_SLACK = 16
# How long the soak leaves the server quiet after a phase before it reads RSS: the engine
# gives back what it holds beyond the model and the cache 2 s after its last request
# (IDLE_RELEASE_S in actors/scheduler.py), then the C heap and MLX's buffer cache shrink.
RELEASE_WAIT_S = 4.0
