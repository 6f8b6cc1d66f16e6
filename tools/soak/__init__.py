"""``troupe soak``: a bounded soak-and-fault run against a real ``troupe serve`` (issue 18).

The run starts the server on 127.0.0.1 (the bundled model unless ``--model``), with small
limits so that every fault is reachable in minutes, and drives it through phases:

- **baseline**: one request of every kind, the held-back greedy answers, the warm RSS and fds;
- **load**: OpenAI and Anthropic, streamed and whole, short chats, long prompts sharing
  prefixes (prefix hits from RAM and disk), ``tools`` and ``response_format`` requests, at a
  concurrency that steps between 1 and 64; a fifth of the streams cut mid-answer, slow
  readers, slow and stalled bodies, connections that send nothing;
- **burst**: 256 requests at once, against ``--max-queue 64``: what does not fit gets 429;
- **disk_full**, **disk_deleted**, **disk_readonly**, **disk_corrupt**: the cache directory
  (on a small tmpfs when run as root) filled to ENOSPC, deleted, made read-only, its block
  files truncated and overwritten, all while serving;
- **kill9**: ``kill -9`` while blocks are being written, then a restart on the same cache;
- **sigterm**: SIGTERM with streams in flight: each ends cleanly, the exit status is 0;
- **final**: traffic again, then a clean stop.

The bad-input corpus (``corpus.py``) is replayed throughout. After every phase: the
server answers ``/health``; greedy answers to held-back prompts are those of the baseline; no
corrupt block was loaded; RSS and open fds are within their bounds; every request got exactly
one terminal outcome. A lost request, a 5xx, a crash, a changed greedy answer, a corrupt
block loaded or a leak fails the run (exit status 1). Writes ``soak.json``, ``soak.md`` and
``soak.png`` (RSS, latency and throughput over time) and the server logs to ``--out``.

    troupe soak                       # 10 minutes, results in soak-results/
    troupe soak --minutes 2 --out /tmp/soak
    make soak ARGS="--minutes 2"

A client only: aiohttp and raw sockets, never MLX, nothing of the server's packages (a rule
of tests/test_import_rules.py). The modules, by concern:

- ``settings``: the server's limits, the traffic's pace, the fault windows, the leak bounds;
- ``traffic``: what the clients send; ``clients``: sending it, a phase at a time;
- ``corpus``: the bad-input cases and the answer each must get;
- ``judge``: the ledger of outcomes and the judging of answers and refusals;
- ``server``: the server under test as a subprocess; ``faults``: the cache directory's
  faults and the fault phases;
- ``report``: ``soak.json``, ``soak.md``, ``soak.png``;
- ``run``: the phases, the checkpoint after each, and the command line (``main``).
"""
