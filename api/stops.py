"""Stop sequences, as every route takes them: non-empty, and bounded in number and in size."""

from __future__ import annotations

from troupe.api.errors import ApiError

# OpenAI's routes take 4 stop sequences (their schemas say so, as OpenAI's API does);
# Anthropic's documents no limit, and real clients send a handful. The bounds keep what the
# engine matches after every token, and the automaton it builds for that on the model's
# thread (actors/engine/output.py), small.
MAX_STOPS = 64
MAX_STOP_CHARS = 2048  # all of a request's stop sequences together


def stop_sequences(stops: list[str], param: str) -> list[str]:
    """``stops``, checked: a 400 naming ``param`` and the bound when one is broken."""
    if any(s == "" for s in stops):
        raise ApiError(400, "Stop sequences must not be empty.", param=param)
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"Too many stop sequences in '{param}': {len(stops)}; the limit "
                       f"is {MAX_STOPS}.", param=param)
    chars = sum(len(s) for s in stops)
    if chars > MAX_STOP_CHARS:
        raise ApiError(400, f"The stop sequences in '{param}' hold {chars} characters; the "
                       f"limit is {MAX_STOP_CHARS} in all.", param=param)
    return stops
