"""runtime/ is the kernel: it knows nothing of MLX or HTTP (actors/ and api/: test_import_rules)."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
FORBIDDEN = {"mlx", "mlx_lm", "aiohttp"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_runtime_imports_neither_mlx_nor_http() -> None:
    files = sorted(RUNTIME.glob("*.py"))
    assert files
    offenders = {f.name: imported_roots(f) & FORBIDDEN for f in files}
    assert {name: bad for name, bad in offenders.items() if bad} == {}
