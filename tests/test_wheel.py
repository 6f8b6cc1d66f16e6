"""The built wheel: everything under one import package, ``troupe``, and it runs from there.

The repository keeps ``runtime/``, ``actors/``, ``api/`` and ``tools/`` at its top;
pyproject.toml installs them as ``troupe.runtime`` and so on, so the wheel claims no generic
top-level name (``api`` and ``runtime`` are used by other distributions).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "actors", "api", "tools")


def _files(*under: str) -> list[str]:
    """The checkout's files that git tracks or would (new ones not yet committed)."""
    return subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                           *under], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.splitlines()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tracked files, so that this checkout's build/ is left alone;
    # with the test extra's setuptools, not one fetched for an isolated build.
    src = out / "src"
    files = _files()
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(out)], check=True,
                   capture_output=True, timeout=300)
    (found,) = out.glob("mlx_troupe-*.whl")
    return found


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"troupe", next(t for t in top if t.endswith(".dist-info"))}


def test_every_module_and_data_file_is_in_the_wheel(wheel: Path) -> None:
    """A new subpackage must be listed in pyproject.toml's ``packages``: this fails if not."""
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = _files(*FOLDERS)
    shipped = [n for n in tracked
               if n.endswith((".py", ".c")) or n.startswith("api/static/")]
    missing = [n for n in shipped if f"troupe/{n}" not in names]
    assert shipped and missing == []
    assert "troupe/__init__.py" in names


def test_the_unpacked_wheel_imports_and_runs_from_its_own_files(wheel: Path,
                                                                tmp_path: Path) -> None:
    """Unpacked away from the checkout, ``troupe`` is found there alone (its package path
    holds no checkout), the CLI answers and the entry point names it."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # The dashboard's page too: package data read through the installed package (it was
    # looked up as a top-level ``api``, which only a checkout's working directory has).
    code = ("import troupe, troupe.api.cli, troupe.actors.engine.core, troupe.runtime; "
            "from troupe.api.dashboard.routes import ASSETS, PAGE, static_file; "
            "assert all(static_file(n) for n in (PAGE, *ASSETS)); "
            "print(list(troupe.__path__)); print(troupe.api.cli.__file__)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path, cli = out.stdout.splitlines()
    assert path == repr([str(site / "troupe")])
    assert cli == str(site / "troupe" / "api" / "cli.py")
    help_ = subprocess.run([sys.executable, "-m", "troupe.api.cli", "--help"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "serve" in help_.stdout, help_.stderr
    entry = next((site).glob("*.dist-info")) / "entry_points.txt"
    assert "troupe = troupe.api.cli:main" in entry.read_text()
