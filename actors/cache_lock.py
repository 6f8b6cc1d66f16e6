"""One server per cache directory: a lock file held for the server's life.

Two servers on one ``--cache-dir`` each kept a quota of their own over the same files (the
directory grew past ``--cache-disk-max``), and each deleted the other's temp files at its
start. The second now refuses to start instead. The lock is ``flock`` on ``troupe.lock`` in the
directory: the kernel drops it when its holder exits however it exits (``kill -9``
included), so a stale file never blocks a restart. It belongs to the open file, not to the
process: two servers in one process conflict too. The file holds the holder's pid, for the
message.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

log = logging.getLogger("actors.cache_lock")

LOCK_FILE = "troupe.lock"


class CacheDirBusy(RuntimeError):
    """Another live server holds the cache directory."""


class CacheDirLock:
    """The lock on one cache directory, held from ``acquire`` until ``release``."""

    def __init__(self, directory: Path, fd: int | None) -> None:
        self.directory = directory
        self._fd = fd

    @classmethod
    def acquire(cls, directory: str | Path) -> CacheDirLock:
        """Take the directory's lock (creating the directory), or raise ``CacheDirBusy``
        naming the process that holds it. Where no lock can be had for another reason (a
        read-only directory, a file system without locks) the directory is used without
        one, with a warning: the lock guards the cache, it is not needed to serve."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        try:
            # Held open read-only: a file open for writing would keep its file system from
            # being remounted read-only.
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            return cls._unlocked(directory, exc)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CacheDirBusy(
                f"the cache directory {directory} is in use by another troupe server"
                f"{f' (pid {holder})' if holder else ''}; give this one its own --cache-dir "
                "(two servers on one directory would each keep its quota, and delete each "
                "other's files)") from None
        except OSError as exc:
            os.close(fd)
            return cls._unlocked(directory, exc)
        try:
            path.write_text(f"{os.getpid()}\n")
        except OSError:
            pass  # the pid only names the holder in another server's message
        return cls(directory, fd)

    @classmethod
    def _unlocked(cls, directory: Path, error: OSError) -> CacheDirLock:
        log.warning("cache %s: not locked (%s): another server could use this directory too",
                    directory, error.strerror or error)
        return cls(directory, None)

    def release(self) -> None:
        """Let another server have the directory (the file stays: removing it would let two
        servers each lock a file of that name)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> int | None:
    """The pid the lock file names, if it names one."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
        return int(text) if text else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None
