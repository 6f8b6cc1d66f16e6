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
    ("BatchRotatingKVCache", "_temporal_order",
     "a drafts' verify pass (several positions) on a sliding window that wrapped while the "
     "rows decoded a token a step: ``make_mask`` reads the wrapped write index before "
     "``update_and_fetch`` puts the buffer back in order, and masks a left-padded row one "
     "position off; put in order first, the two agree (actors/engine/runner.py)"),
)


# Private methods troupe replaces, fixed: (module, class, method, why).
PATCHED: tuple[tuple[str, str, str, str], ...] = (
    ("mlx_lm.models.nemotron_h", "NemotronHMamba2Mixer", "_ssm",
     "it drops the cache's lengths when it calls ssm_update (as granitemoehybrid's does, "
     "ml-explore/mlx-lm#1908; mamba2's passes them), so a shorter prompt right-padded in a "
     "batched prefill takes its state from the padding (actors/engine/runner.py)"),
)


def patch_models() -> None:
    """Replace the methods in ``PATCHED`` with fixed ones (idempotent): called before a model
    is batched."""
    from mlx_lm.models import nemotron_h

    nemotron_h.NemotronHMamba2Mixer._ssm = _nemotron_h_ssm


def _nemotron_h_ssm(self: Any, hidden_states: Any, B: Any, C: Any, dt: Any, cache: Any,
                    mask: Any) -> Any:
    """mlx-lm 0.32.2's ``NemotronHMamba2Mixer._ssm``, passing the cache's lengths on."""
    from mlx_lm.models.ssm import ssm_update

    batch_size, seq_len, _ = hidden_states.shape
    hidden_states = hidden_states.reshape(batch_size, seq_len, self.num_heads, self.head_dim)
    B = B.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
    C = C.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
    state, lengths = (cache[1], cache.lengths) if cache else (None, None)
    y, state = ssm_update(hidden_states, self.A_log, B, C, self.D.astype(hidden_states.dtype),
                          dt, self.dt_bias, state, self.time_step_limit, mask, lengths)
    if cache:
        cache[1] = state
    return y.reshape(batch_size, seq_len, self.intermediate_size)


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


def in_temporal_order(cache: Any) -> None:
    """``BatchRotatingKVCache._temporal_order``: a wrapped window's buffer rolled back into
    the order of its positions (see ``ATTRIBUTES``)."""
    cache._temporal_order()


def hf_tokenizer(wrapper: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (or the object itself
    when it is not a wrapper)."""
    return getattr(wrapper, "_tokenizer", wrapper)
