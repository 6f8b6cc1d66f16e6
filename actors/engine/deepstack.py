"""Qwen3-VL's deepstack on mlx-lm's text model: the vision tower hands the language model an
image's features from some of its own blocks besides its last, and each set is added to the
hidden states leaving one of the language model's first layers, at the image's tokens (as
mlx-vlm's ``Qwen3VLModel`` does). ``Deepstack`` wraps those layers; the runner gives a prefill
call the additions of its chunk (``fed``), and every other call runs the layers untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _FedLayer(nn.Module):
    """A decoder layer whose output takes the chunk's additions for it, if any."""

    def __init__(self, layer: nn.Module, index: int, owner: Deepstack) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        self.owner = owner  # not a module: its state is per call, never a parameter

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        h = self.layer(x, *args, **kwargs)
        adds = self.owner.adds
        return h if adds is None else h + adds[self.index].astype(h.dtype)


class Deepstack:
    """The first ``levels`` decoder layers of a Qwen3-VL checkpoint's text model (mlx-lm's),
    wrapped to take the additions the runner gives a call (``fed``)."""

    def __init__(self, model: Any, levels: int) -> None:
        self.levels = levels
        self.adds: list[mx.array] | None = None
        layers = model.layers  # the text model's own list: its loop reads the wrappers
        for i in range(levels):
            layers[i] = _FedLayer(layers[i], i, self)

    @contextmanager
    def fed(self, adds: list[mx.array]) -> Iterator[None]:
        """The model calls inside add ``adds[i]`` ([rows, tokens, hidden], zero away from
        image tokens) to the output of layer i."""
        self.adds = adds
        try:
            yield
        finally:
            self.adds = None
