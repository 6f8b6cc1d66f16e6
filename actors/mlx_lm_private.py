"""mlx-lm's private names troupe reaches, in one place, each with its reason, and the versions
of mlx-lm they were checked on.

mlx-lm's public API gives models, caches, samplers, logits processors, tokenizers, chat
templates and ``BatchGenerator``'s ``insert``/``next``/``remove``. Continuous batching with
one forward pass a step, a per-chunk memory gate and a prefix cache needs to see and steer
what ``BatchGenerator`` keeps inside (``actors/engine/batch.py``, ``actors/engine/core.py``);
those names are listed here. ``check_mlx_lm`` refuses to serve on a version they were not
checked on, and ``tests/test_mlx_lm_private.py`` checks that every name listed still exists.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

# The mlx-lm versions the test suite ran on (pyproject.toml pins the same).
TESTED_MLX_LM = ("0.32.2",)

# Private functions troupe calls: (module, name, why).
FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("mlx_lm.generate", "_right_pad_prompts",
     "a prefill chunk riding in the decode step is padded exactly as mlx-lm's own prompt "
     "batch pads it (actors/engine/batch.py)"),
    ("mlx_lm.utils", "_download",
     "a Hugging Face repo named on the command line is fetched as mlx-lm's load fetches it "
     "(actors/models/store.py)"),
)

# Private attributes troupe reads or sets: (class, attribute, why). Attributes an instance
# sets in its constructor are checked on an instance.
ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("BatchGenerator", "_prompt_batch",
     "the sequences being prefilled: the memory gate measures them, the prefill budget sizes "
     "their chunk, and mixed steps run their chunk in the decode pass"),
    ("BatchGenerator", "_generation_batch",
     "the decoding sequences: replaced by troupe's JoiningGenerationBatch (answers in the "
     "step, ragged caches)"),
    ("BatchGenerator", "_unprocessed_sequences",
     "the queue not yet in a batch: the gate and the chunk plan see who would join, and it "
     "is reordered so that long prompts start shortest first"),
    ("BatchGenerator", "_currently_processing",
     "each prefilling sequence's remaining segments: the step takes their next chunk"),
    ("BatchGenerator", "_counters", "prompt and decode token counts for the step's timing"),
    ("BatchGenerator", "_next", "overridden: the one-pass mixed step"),
    ("BatchGenerator", "_make_batch",
     "extended: a single cached prefix keeps its arrays instead of mlx-lm's merge copy"),
    ("BatchGenerator", "_find_uids", "whether a sequence is still in the batch before a cut"),
    ("GenerationBatch", "_step", "overridden: the step answers the tokens it sampled"),
    ("GenerationBatch", "_next_tokens", "the sampled tokens the step answers"),
    ("GenerationBatch", "_next_logprobs", "their log-probabilities"),
    ("BatchKVCache", "_idx",
     "the positions in use: joins and rolls copy only those, not the room to grow"),
    ("BatchKVCache", "_right_padding", "a prefill chunk's right padding, rolled only once"),
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
            f"{', '.join(TESTED_MLX_LM)} only (it steers mlx-lm's batch generator from inside: "
            f"see actors/mlx_lm_private.py). Install it with: "
            f"pip install 'mlx-lm=={TESTED_MLX_LM[-1]}'"
        )
    return found


def right_pad_prompts(prompts: list[list[int]], max_length: int) -> Any:
    """``mlx_lm.generate._right_pad_prompts``: prompts right-padded to ``max_length``."""
    from mlx_lm.generate import _right_pad_prompts

    return _right_pad_prompts(prompts, max_length=max_length)


def download(repo_id: str) -> str:
    """``mlx_lm.utils._download``: a Hugging Face repo's files, fetched as mlx-lm's load does."""
    from mlx_lm.utils import _download

    return _download(repo_id)


def hf_tokenizer(wrapper: Any) -> Any:
    """The Hugging Face tokenizer inside an mlx-lm ``TokenizerWrapper`` (or the object itself
    when it is not a wrapper)."""
    return getattr(wrapper, "_tokenizer", wrapper)
