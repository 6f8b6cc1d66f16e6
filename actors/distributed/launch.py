"""Starting a rank of a sharded model under ``mlx.launch`` (``troupe serve --distributed``):
rank 0 gets back the configuration it serves with; every other rank loads its shard, connects
to rank 0 and follows its batch until rank 0 stops.

The wiring passes in what it decides (the models named, the base cache directory, how a
follower opens its disk): nothing here imports the serving layer or an actor.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from troupe.actors.distributed.follower import connect, follow
from troupe.actors.distributed.protocol import read_secret
from troupe.actors.distributed.shards import MODES, engine_config_for, load_shard, rank_cache_dir

log = logging.getLogger(__name__)

# Opens a follower's disk tier: (its directory, the model's fingerprint, the quota in bytes,
# block_size=tokens per block) -> the disk, with ``close()``. Passed in by the wiring: this
# package imports no actor.
OpenDisk = Callable[..., Any]


def start_rank(config: Any, models: list[str | None], cache_base: str | Path,
               open_disk: OpenDisk) -> tuple[Any, int | None]:
    """Join the group ``mlx.launch`` started, for ``troupe serve --distributed``.

    ``config``: the ``ServeConfig``; ``models``: the models it names (one, or None for the
    bundled default); ``cache_base``: the prefix cache's directory, under which every rank
    keeps its own (``rank_cache_dir``); ``open_disk``: opens a follower's disk tier in its
    directory (``follower_disk.FollowerDisk``). Rank 0 gets back the configuration to serve with
    (that directory, and for pipeline stages mlx-lm's own model call: ``engine_config_for``)
    and None; every other rank follows rank 0 until it stops and gets back its exit code.
    Raises ValueError when this rank has no usable shared secret (``read_secret``)."""
    import mlx.core as mx

    mode = config.engine.distributed
    if mode not in MODES:
        raise ValueError(f"--distributed must be one of {MODES}, not {mode!r}")
    if len(models) != 1:
        raise ValueError("--distributed serves one model; give --model once")
    group = mx.distributed.init()
    if group.size() < 2:
        raise RuntimeError("--distributed needs the ranks of `mlx.launch` (this process is "
                           "alone in its group); see docs/distributed.md")
    read_secret()  # every rank stops here, saying why, before it loads its shard
    engine = engine_config_for(config.engine, mode)
    here = rank_cache_dir(cache_base, mode, group.size(), group.rank())
    config = msgspec.structs.replace(config, engine=engine, cache_dir=str(here))
    if group.rank() == 0:
        log.info("distributed: rank 0 of %d (%s parallel); prefix cache in %s",
                 group.size(), mode, here if engine.block_size else "(off)")
        return config, None
    return config, _serve_follower(config, models[0], group, open_disk)


def _serve_follower(config: Any, spec: str | None, group: Any, open_disk: OpenDisk) -> int:
    """A follower rank: load its shard, connect to rank 0, run its batch until it stops."""
    import mlx.core as mx

    from troupe.actors.engine.core import Engine
    from troupe.actors.engine.grammar import Grammars
    from troupe.actors.engine.prefix import model_fingerprint
    from troupe.actors.models.store import resolve_model

    rank = group.rank()
    signals = 0

    def on_signal(signum: int, frame: Any) -> None:
        # mlx.launch signals every rank at once: a follower stops when rank 0 has finished
        # what is in flight and says so (or goes away); a second signal stops it now.
        nonlocal signals
        signals += 1
        if signals > 1:
            raise SystemExit(1)
        log.info("distributed rank %d: stopping when rank 0 stops", rank)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    resolved = resolve_model(spec)
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        model, tokenizer = load_shard(str(resolved.path), config.engine.distributed, group)
    fingerprint = model_fingerprint(resolved.path)
    sock, welcome = connect(rank, config.engine.distributed_port, fingerprint, read_secret())
    log.info("distributed: rank %d of %d follows rank 0 (%s parallel)", rank, group.size(),
             config.engine.distributed)
    mx.random.seed(welcome.seed)
    with mx.stream(stream):
        # The fingerprint names the blocks: every rank's hashes of a prompt are rank 0's.
        engine = Engine(model, tokenizer, welcome.config, stream=stream,
                        fingerprint=fingerprint)
        disk = (open_disk(config.cache_dir, fingerprint, config.cache_disk_max,
                          block_size=engine.block_size)
                if engine.caching else None)
        engine.warm_up()  # rank 0 warms up too: the same forward passes, in step
        try:
            return follow(engine, sock, rank, Grammars(tokenizer), disk)
        finally:
            # Exiting now: a signal still on its way (mlx.launch signals every rank, and rank 0
            # may finish first) must not land after the interpreter has restored the default
            # handlers at exit, which would end this rank with -SIGTERM instead of its code.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            if disk is not None:
                disk.close()
            engine.close()
            sock.close()
