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
# The one import package the folders below install as (pyproject.toml's package-dir).
PACKAGE = "troupe"
FOLDERS = ("runtime", "actors", "api", "tools")
# What api/ may import from actors/ when a module loads; commands import the rest lazily.
# actors.images: the image part's shape and its base64 check (Pillow only when decoding).
API_MAY_LOAD = ("actors.messages", "actors.config", "actors.images")


def _imports(path: Path, *, module_level_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, the project's own named by
    their folders (``troupe.actors.pool`` as ``actors.pool``).

    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule). With
    ``module_level_only``, imports inside functions (run only when called) are skipped.
    """
    for line, module in _raw_imports(path, module_level_only=module_level_only):
        yield line, module.removeprefix(f"{PACKAGE}.")


def _raw_imports(path: Path, *, module_level_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module name as written) of every import in the file."""
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


def test_the_project_is_imported_by_its_installed_names() -> None:
    """Every import of the project's folders names them under ``troupe.``, as the wheel
    installs them; a bare ``import actors`` would load a second copy of each module from a
    checkout and fail in an installed server."""
    files = sorted(p for folder in (*FOLDERS, "tests", "benchmarks", "examples")
                   if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob("*.py"))
    offences = [f"{path.relative_to(ROOT)}:{line} imports {module}"
                for path in files for line, module in _raw_imports(path)
                if _top(module) in FOLDERS]
    assert offences == []


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
    result = _loads_mlx("import troupe.api.app, troupe.api.cli, troupe.api.openai")
    assert result.returncode == 0, result.stderr


SSD_WRITER = ROOT / "actors" / "ssd_writer.py"


def test_ssd_writer_imports_no_mlx() -> None:
    if not SSD_WRITER.exists():
        pytest.skip("actors/ssd_writer.py is not written yet")
    assert [module for _, module in _imports(SSD_WRITER) if _top(module) in MLX] == []
    result = _loads_mlx("import troupe.actors.ssd_writer")
    assert result.returncode == 0, result.stderr


def _actor_modules() -> set[str]:
    """The modules of actors/ that define an actor (a class whose bases name ``Actor``), or a
    part of one in a module of its own, which talks to actors (it imports ``ActorRef``: the
    scheduler's disk tier). A messages module may name ``ActorRef`` (an asker's, to answer
    to) and stays a messages module."""
    found = set()
    for path in sorted((ROOT / "actors").glob("*.py")):
        if path.stem.endswith("messages"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "Actor" for b in node.bases)
               for node in ast.walk(tree)) or "runtime.ActorRef" in {
                m for _, m in _imports(path)}:
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


# -- the layers, each importing only those below ----------------------------------------------

LAYERS = ("runtime", "messages", "pure logic", "engine", "distributed", "actors", "wiring",
          "api")
WIRING = {"actors.serving", "actors.config"}
# Pure logic that lives in the engine's package, beside the MLX code it plans for.
ENGINE_PURE = {"actors.engine.schedule", "actors.engine.memory_estimate",
               "actors.engine.lru", "actors.engine.config",
               # The text stage, which runs off the MLX thread, and the parser it feeds.
               "actors.engine.text", "actors.engine.agent_output"}
# Modules of actors/ with no actor and no MLX thread that build on the engine's code: a
# request's prompt (templates, tokens, grammars), which admission builds in its pool.
BESIDE_ENGINE = {"actors.prompts"}
# Today's imports against the layers, each with why it stays (for now).
LAYER_EXCEPTIONS = {
    # The template time limit's one default lives with the served settings; admission uses
    # it as its own default. Moving it below would split the setting from its CLI help.
    ("actors.admission", "actors.config"),
    # The follower's block store converts the engine's KV blocks; it belongs with the
    # distributed package (i35-dist), where the engine is below it.
    ("actors.follower_cache", "actors.engine.kv_blocks"),
    # The memory estimate asks whether the engine's CPU attention is on (a lazy import, so
    # it stays MLX-free); the engine could pass that in (i35-core's files).
    ("actors.engine.memory_estimate", "actors.engine.cpu_kernels"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str, actors: set[str]) -> int:
    """The layer of a module of this project, from where it sits and what it defines."""
    if _top(module) == "runtime":
        return LAYERS.index("runtime")
    if _top(module) == "api":
        return LAYERS.index("api")
    if module in WIRING:
        return LAYERS.index("wiring")
    if module.startswith("actors.distributed"):
        return LAYERS.index("distributed")
    if module in ENGINE_PURE:
        return LAYERS.index("pure logic")
    if module.startswith(("actors.engine", "actors.models")) or module in BESIDE_ENGINE:
        return LAYERS.index("engine")
    if module in actors:
        return LAYERS.index("actors")
    if module == "actors" or module.endswith("messages"):
        return LAYERS.index("messages")
    return LAYERS.index("pure logic")  # the rest of actors/: no actor, no MLX engine


def _project_modules() -> dict[str, Path]:
    return {_module_name(path): path
            for package in ("runtime", "actors", "api") for path in _sources(package)}


def _layer_offences() -> list[tuple[str, str, str]]:
    """(importer, imported, where) for every import of a higher layer, lazy ones included."""
    modules, actors = _project_modules(), _actor_modules()
    found = []
    for module, path in modules.items():
        imports = list(_imports(path))
        for line, name in imports:
            # ``from a import b`` names ``a.b``: the module if it is one, else ``a``; a
            # package that only leads to its submodule (``from a import b``) is not counted.
            target = name if name in modules else name.rpartition(".")[0]
            if any(n.startswith(f"{name}.") and n in modules for ln, n in imports if ln == line):
                continue
            if target in modules and _layer(target, actors) > _layer(module, actors):
                found.append((module, target, f"{path.relative_to(ROOT)}:{line}"))
    return found


def test_the_layers_are_derived_from_the_code() -> None:
    """A new module lands in a layer by what it is: an actor's module by its Actor class."""
    actors = _actor_modules()
    layer = {m: LAYERS[_layer(m, actors)] for m in _project_modules()}
    assert layer["actors.messages"] == layer["actors.cache_messages"] == "messages"
    assert layer["actors.memory_messages"] == "messages"
    assert layer["actors.engine.schedule"] == layer["actors.block_store"] == "pure logic"
    assert layer["actors.engine.core"] == layer["actors.models.store"] == "engine"
    assert layer["actors.prompts"] == "engine"
    assert layer["actors.distributed.leader"] == "distributed"
    assert {layer[m] for m in ("actors.scheduler", "actors.pool", "actors.cache_index",
                               "actors.ssd_writer", "actors.admission",
                               "actors.disk_tier")} == {"actors"}
    assert layer["actors.serving"] == "wiring" and layer["api.app"] == "api"


def test_each_layer_imports_only_the_layers_below() -> None:
    """runtime, messages, pure logic, the MLX engine and models, ``distributed/``, one actor
    per module, the wiring, ``api/``: none imports a layer above it, not even lazily."""
    offences = [f"{where} ({importer}) imports {target}"
                for importer, target, where in _layer_offences()
                if (importer, target) not in LAYER_EXCEPTIONS]
    assert offences == []


def test_each_named_layer_exception_is_still_needed() -> None:
    """An exception the code no longer needs is deleted, so the list stays the truth."""
    assert LAYER_EXCEPTIONS <= {(i, t) for i, t, _ in _layer_offences()}


def test_the_text_stage_loads_no_mlx() -> None:
    """The text stage runs beside the MLX thread, on plain numbers: it never loads MLX."""
    path = ROOT / "actors" / "engine" / "text.py"
    assert [module for _, module in _imports(path) if _top(module) in MLX] == []
    result = _loads_mlx("import troupe.actors.engine.text")
    assert result.returncode == 0, result.stderr
