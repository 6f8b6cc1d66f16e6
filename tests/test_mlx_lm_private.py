"""The mlx-lm private names troupe reaches (actors/mlx_lm_private.py) exist in the installed
mlx-lm, and serving refuses an mlx-lm version it was not tested on."""

from __future__ import annotations

import importlib
import inspect

import pytest

from troupe.actors import mlx_lm_private
from troupe.actors.mlx_lm_private import ATTRIBUTES, FUNCTIONS, PATCHED, UntestedMlxLm, check_mlx_lm


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, n, _ in FUNCTIONS])
def test_each_private_function_listed_exists(module: str, name: str) -> None:
    assert callable(getattr(importlib.import_module(module), name, None))


def test_each_private_attribute_listed_exists(loaded) -> None:
    from mlx_lm.models.cache import BatchRotatingKVCache

    _, tok = loaded
    instances = {"TokenizerWrapper": tok, "BatchRotatingKVCache": BatchRotatingKVCache(8, [0])}
    missing = [f"{cls}.{attr}" for cls, attr, _ in ATTRIBUTES
               if not hasattr(instances[cls], attr)]
    assert not missing, f"mlx-lm no longer has {missing}: update actors/mlx_lm_private.py"


def test_the_installed_mlx_lm_is_a_tested_one() -> None:
    assert check_mlx_lm() in mlx_lm_private.TESTED_MLX_LM


def test_an_untested_mlx_lm_is_refused_with_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(mlx_lm_private, "mlx_lm_version", lambda: "0.99.0")
    with pytest.raises(UntestedMlxLm, match=r"mlx-lm 0\.99\.0 is installed.*pip install"):
        check_mlx_lm()


@pytest.mark.parametrize(("module", "cls", "method"), [(m, c, n) for m, c, n, _ in PATCHED])
def test_each_patched_method_is_still_in_mlx_lm(module: str, cls: str, method: str) -> None:
    """Read off the source: once patched, the class has the method whatever mlx-lm has."""
    source = inspect.getsource(getattr(importlib.import_module(module), cls))
    assert f"def {method}(" in source, f"mlx-lm's {cls} has no {method}: update PATCHED"
