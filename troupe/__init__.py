"""mlx-troupe's one import package: ``troupe.runtime``, ``troupe.actors``, ``troupe.api`` and
``troupe.tools``.

An installed wheel holds them under ``troupe/`` (pyproject.toml maps the repository's
top-level folders there), so the project claims no generic top-level name such as ``api``. Run
from a checkout (tests, ``python -m troupe.api.cli``), the folders stay where they are and this
package also looks in the repository's root for its subpackages.
"""

from pathlib import Path

_root = Path(__file__).resolve().parents[1]
# A checkout, not site-packages: the project file and the engine sit beside this package.
if (_root / "pyproject.toml").is_file() and (_root / "actors" / "engine").is_dir():
    __path__.append(str(_root))
