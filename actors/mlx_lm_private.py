"""mlx-lm's private names troupe reaches, in one place, each with its reason, and the versions
of mlx-lm they were checked on.

Troupe uses mlx-lm through its public API: models, cache classes, samplers, logits
processors, tokenizers, chat templates and tool parsers (the engine's batch is troupe's own,
``actors/engine/batch.py``). The few private names left are listed here and used from here
only: ``tests/test_mlx_lm_public_api.py`` walks the code and fails on a private mlx-lm name
used anywhere else, and ``tests/test_mlx_lm_private.py`` checks that every name listed still
exists. ``check_mlx_lm`` refuses to serve on a version they were not checked on.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

# The mlx-lm versions the test suite ran on (pyproject.toml pins the same).
TESTED_MLX_LM = ("0.32.2",)

# Private functions troupe calls: (module, name, why).
FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("mlx_lm.utils", "_download",
     "a Hugging Face repo named on the command line is fetched as mlx-lm's load fetches it "
     "(actors/models/store.py)"),
)

# Private attributes troupe reads: (class, attribute, why). Attributes an instance sets in
# its constructor are checked on an instance.
ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("TokenizerWrapper", "_tokenizer",
     "the Hugging Face tokenizer llguidance builds its token table from "
     "(actors/engine/grammar.py)"),
)


class UntestedMlxLm(RuntimeError):
    """The installed mlx-lm is not one troupe was tested on."""


def mlx_lm_version() -> str | None:
    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return None


def check_mlx_lm() -> str:
    """The installed mlx-lm's version; raises UntestedMlxLm with what to do on any other."""
    found = mlx_lm_version()
    if found not in TESTED_MLX_LM:
        raise UntestedMlxLm(
            f"mlx-lm {found} is installed, but mlx-troupe was tested on mlx-lm "
            f"{', '.join(TESTED_MLX_LM)} only (it reaches a few of mlx-lm's private names: "
            f"see actors/mlx_lm_private.py). Install it with: "
            f"pip install 'mlx-lm=={TESTED_MLX_LM[-1]}'"
        )
    return found


def download(repo_id: str) -> str:
    """``mlx_lm.utils._download``: a Hugging Face repo's files, fetched as mlx-lm's load does."""
    from mlx_lm.utils import _download

    return _download(repo_id)


def hf_tokenizer(wrapper: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (or the object itself
    when it is not a wrapper)."""
    return getattr(wrapper, "_tokenizer", wrapper)
