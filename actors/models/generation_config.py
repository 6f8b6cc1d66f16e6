"""A model's own sampling defaults, from the ``generation_config.json`` beside its weights.

Model makers put their recommended sampling there (Qwen: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05); mlx-lm reads only its ``eos_token_id``. As in vLLM, the sampling keys
(``DEFAULTABLE``) become the defaults of requests that do not set them; ``do_sample`` is not
read (an API request samples unless its temperature is 0), nor ``max_new_tokens`` (the server's
``--default-max-tokens`` and the context decide an answer's length).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgspec

from troupe.actors.messages import DEFAULTABLE, SamplingDefaults

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def sampling_defaults(model_dir: str | Path) -> SamplingDefaults:
    """The sampling defaults ``model_dir``'s generation_config.json sets (none without one).
    A value out of its field's range, or of the wrong type, is skipped with a warning; the
    others still count."""
    path = Path(model_dir) / GENERATION_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): no sampling defaults from it", path, exc)
        return SamplingDefaults()
    if not isinstance(config, dict):
        log.warning("%s is not a JSON object: no sampling defaults from it", path)
        return SamplingDefaults()
    found = {}
    for name in DEFAULTABLE:
        if config.get(name) is None:
            continue
        try:
            # One field at a time, so that one bad value does not drop the others.
            msgspec.convert({name: config[name]}, SamplingDefaults)
        except msgspec.ValidationError as exc:
            log.warning("%s: %s %r skipped (%s)", path, name, config[name], exc)
            continue
        found[name] = config[name]
    return msgspec.convert(found, SamplingDefaults)
