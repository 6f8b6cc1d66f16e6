"""The layering rules of docs/design.md, checked on the source and on a fresh interpreter.

runtime/ knows nothing of actors/ or api/; api/ never imports MLX, not even through what it
imports; the SSD writer's module never imports MLX (it receives numpy snapshots only); tools/
is a client of the server, imported only by the CLI's ``soak`` command, and imports none of
the server's packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MLX = ("mlx", "mlx_lm")
# What api/ may import from actors/ when a module loads; commands import the rest lazily.
API_MAY_LOAD = ("actors.messages", "actors.config")


def _imports(path: Path, *, module_level_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file.

    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule). With
    ``module_level_only``, imports inside functions (run only when called) are skipped.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    skip: set[int] = set()
    if module_level_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                skip.update(id(inner) for inner in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _top(module: str) -> str:
    return module.split(".")[0]


def _sources(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    return files


def _offences(package: str, banned: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources(package)
        for line, module in _imports(path)
        if _top(module) in banned
    ]


def test_runtime_imports_neither_actors_nor_api() -> None:
    assert _offences("runtime", ("actors", "api")) == []


def test_api_imports_no_mlx() -> None:
    assert _offences("api", MLX) == []


def test_api_loads_only_messages_and_config_from_actors() -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module} at module level"
        for path in _sources("api")
        for line, module in _imports(path, module_level_only=True)
        if _top(module) == "actors"
        and module != "actors"
        and not any(module == m or module.startswith(f"{m}.") for m in API_MAY_LOAD)
    ]
    assert offences == []


def test_only_the_soak_command_imports_tools() -> None:
    # api/cli.py's `soak` imports tools/ inside the command: the server never loads it.
    lazy_in_cli = {
        (line, module) for line, module in _imports(ROOT / "api" / "cli.py")
    } - set(_imports(ROOT / "api" / "cli.py", module_level_only=True))
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for package in ("runtime", "actors", "api")
        for path in _sources(package)
        for line, module in _imports(path)
        if _top(module) == "tools"
        and not (path == ROOT / "api" / "cli.py" and (line, module) in lazy_in_cli)
    ]
    assert offences == []


def test_tools_import_none_of_the_server() -> None:
    # The soak talks to a `troupe serve` over HTTP only, as any client would.
    assert _offences("tools", ("runtime", "actors", "api", *MLX)) == []


def _loads_mlx(imports: str) -> subprocess.CompletedProcess[str]:
    code = (
        f"{imports}; import sys; "
        "loaded = sorted(m for m in sys.modules "
        "if m == 'mlx' or m.startswith('mlx.') or m.startswith('mlx_lm')); "
        "assert not loaded, loaded"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_importing_api_loads_no_mlx() -> None:
    result = _loads_mlx("import api.app, api.cli, api.openai")
    assert result.returncode == 0, result.stderr


SSD_WRITER = ROOT / "actors" / "ssd_writer.py"


def test_ssd_writer_imports_no_mlx() -> None:
    if not SSD_WRITER.exists():
        pytest.skip("actors/ssd_writer.py is not written yet")
    assert [module for _, module in _imports(SSD_WRITER) if _top(module) in MLX] == []
    result = _loads_mlx("import actors.ssd_writer")
    assert result.returncode == 0, result.stderr


def _actor_modules() -> set[str]:
    """The modules of actors/ that define an actor (a class whose bases name ``Actor``)."""
    found = set()
    for path in sorted((ROOT / "actors").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "Actor" for b in node.bases)
               for node in ast.walk(tree)):
            found.add(f"actors.{path.stem}")
    return found


def test_the_distributed_package_imports_no_actor_wiring_or_api() -> None:
    """The layers run runtime, messages, pure logic, the engine, ``distributed/``, the actors,
    the wiring, ``api/``: the wiring passes the distributed package what it needs, and nothing
    in it imports an actor's module, the serving layer, the config or the HTTP layer, not even
    lazily inside a function."""
    actors = _actor_modules()
    assert {"actors.scheduler", "actors.cache_index", "actors.follower_disk"} <= actors
    banned = actors | {"actors.serving", "actors.config"}
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources("actors/distributed")
        for line, module in _imports(path)
        if _top(module) == "api" or any(module == m or module.startswith(f"{m}.")
                                        for m in banned)
    ]
    assert offences == []


def test_the_memory_monitor_does_not_import_distributed() -> None:
    """The other ranks' memory reaches the monitor as a message, not through a module global
    of the distributed package."""
    path = ROOT / "actors" / "memory_monitor.py"
    assert [m for _, m in _imports(path) if m.startswith("actors.distributed")] == []
