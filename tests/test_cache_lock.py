"""One server per cache directory (actors/cache_lock.py): a second server on a directory a live
one holds refuses to start, naming the directory and the holder; a dead holder's file blocks
nothing; the ranks of a sharded model each lock their own directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from troupe.actors.cache_lock import LOCK_FILE, CacheDirBusy, CacheDirLock
from troupe.actors.distributed.shards import rank_cache_dir
from troupe.actors.follower_disk import FollowerDisk

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_lock_on_a_directory_is_refused_until_the_first_is_released(tmp_path):
    first = CacheDirLock.acquire(tmp_path / "kv")  # the directory is made
    # A lock belongs to the open file: a second server in the same process conflicts too.
    with pytest.raises(CacheDirBusy) as refused:
        CacheDirLock.acquire(tmp_path / "kv")
    message = str(refused.value)
    assert str(tmp_path / "kv") in message and f"pid {os.getpid()}" in message
    assert "--cache-dir" in message
    first.release()
    CacheDirLock.acquire(tmp_path / "kv").release()


def test_a_lock_file_left_by_a_dead_server_blocks_nothing(tmp_path):
    (tmp_path / LOCK_FILE).write_text("999999999\n")  # a server killed with -9 left it
    lock = CacheDirLock.acquire(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    lock.release()


def test_a_directory_another_process_holds_is_refused_naming_that_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from troupe.actors.cache_lock import CacheDirLock
            CacheDirLock.acquire({str(tmp_path)!r})
            print("held", flush=True)
            sys.stdin.read()
        """)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(CacheDirBusy, match=f"pid {holder.pid}"):
            CacheDirLock.acquire(tmp_path)
    finally:
        holder.communicate("")  # its stdin closes: it exits, and the kernel drops its lock
    CacheDirLock.acquire(tmp_path).release()


def test_the_ranks_of_a_sharded_model_each_lock_their_own_directory(tmp_path):
    """Rank 0's server locks its rank's directory, each follower's disk its own, and a plain
    server may use the base directory beside them; a second follower on a rank's directory
    is refused."""
    rank0 = CacheDirLock.acquire(rank_cache_dir(tmp_path, "tensor", 2, 0))
    disk1 = FollowerDisk(rank_cache_dir(tmp_path, "tensor", 2, 1), "fp", 1 << 30)
    plain = CacheDirLock.acquire(tmp_path)
    with pytest.raises(CacheDirBusy):
        FollowerDisk(rank_cache_dir(tmp_path, "tensor", 2, 1), "fp", 1 << 30)
    disk1.close()
    FollowerDisk(rank_cache_dir(tmp_path, "tensor", 2, 1), "fp", 1 << 30).close()
    rank0.release()
    plain.release()


def test_a_read_only_directory_is_served_without_a_lock(tmp_path, caplog):
    if os.geteuid() == 0:
        pytest.skip("root ignores permission bits")
    tmp_path.chmod(0o555)
    try:
        CacheDirLock.acquire(tmp_path).release()
    finally:
        tmp_path.chmod(0o755)
    assert "not locked" in caplog.text


async def test_a_second_server_on_a_cache_directory_refuses_to_start_until_the_first_stops(
        tiny_model_dir, tmp_path):
    from troupe.actors.config import ServeConfig
    from troupe.actors.serving import start_serving
    from troupe.runtime import ActorSystem

    config = ServeConfig(model=str(tiny_model_dir), cache_dir=str(tmp_path / "kv"))
    async with ActorSystem() as first:
        await start_serving(first, config)
        async with ActorSystem() as second:
            with pytest.raises(CacheDirBusy, match="in use by another troupe server"):
                await start_serving(second, config)
    async with ActorSystem() as again:  # the first stopped, and let the directory go
        await start_serving(again, config)


async def test_the_pool_stops_what_it_started_before_it_lets_the_directory_go(
        tiny_model_dir, tmp_path):
    """The first model's scheduler, cache index and SSD writer are spawned inside the pool's
    own start, so the system's reverse start order would stop them after the pool: the pool
    stops them itself, then releases the lock (no write lands after the directory is let go)."""
    from troupe.actors.config import ServeConfig
    from troupe.actors.serving import start_serving
    from troupe.runtime import ActorSystem

    config = ServeConfig(model=str(tiny_model_dir), cache_dir=str(tmp_path / "kv"))
    async with ActorSystem() as system:
        handles = await start_serving(system, config)
        assert handles.pool is not None
        started = [system.find(name) for name in
                   ("scheduler", "cache_index", "ssd_writer", "memory_monitor")]
        assert all(ref is not None and ref.alive for ref in started)
        await system.stop(handles.pool)
        assert [ref.alive for ref in started if ref is not None] == [False] * 4
        CacheDirLock.acquire(tmp_path / "kv").release()  # free
