"""M-RoPE for the Qwen-VL family's images, on mlx-lm's text model.

The Qwen-VL family rotates each token by three position ids (temporal, height, width): a
text token's three are equal (plain RoPE), an image's tokens take their place in the image's
grid of merged patches, and the text after an image goes on from one past the image's largest
position. So a prompt's positions run behind its token indices by ``delta`` once it holds an
image (``rope_deltas`` in mlx-vlm and transformers' ``get_rope_index``, ported in ``place``).

mlx-lm's text model for these checkpoints rotates by ``cache.offset`` alone. ``MRoPE`` wraps
each attention layer's rope: a call the runner places (``placed``) shifts each row's offset by
that row's delta (mlx-lm's own rope, as for text) and, for the rows whose chunk holds image
tokens, rotates by their explicit three position ids instead. One copy of the language weights,
troupe's batched caches as they are; an unplaced call (text alone) is mlx-lm's rope untouched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from troupe.actors.engine.vision import split_image_token

# The families whose images are placed by M-RoPE, checked against mlx-vlm's generation in
# tests/test_vision.py: by model type, whether the head's frequencies take the three positions
# in turn (temporal, height, width, temporal...: Qwen3-VL, Qwen3.5) or in contiguous sections.
MROPE_MODEL_TYPES = {"qwen2_vl": False, "qwen2_5_vl": False, "qwen3_vl": True,
                     "qwen3_vl_moe": True, "qwen3_5": True, "qwen3_5_moe": True}


@dataclass(frozen=True)
class Placement:
    """A prompt's M-RoPE positions: ``positions`` [3, prompt tokens] (temporal, height,
    width), and ``delta``: a token past the prompt's last image sits at its index + delta."""

    positions: np.ndarray
    delta: int

    def chunk(self, start: int, n: int) -> np.ndarray:
        """The positions [3, n] of the tokens ``start`` .. ``start + n`` (past the prompt:
        text, at index + delta)."""
        inside = self.positions[:, start:start + n]
        past = np.arange(start + inside.shape[1], start + n) + self.delta
        return np.concatenate([inside, np.broadcast_to(past, (3, len(past)))], axis=1)

    def shift(self, start: int) -> int:
        """Position minus index of the text token at ``start`` (constant along text)."""
        if start >= self.positions.shape[1]:
            return self.delta
        return int(self.positions[0, start]) - start


def place(tokens: Sequence[int], grids: Mapping[int, tuple[int, int, int]], merge: int
          ) -> Placement:
    """The M-RoPE positions of a prompt whose image tokens are negative ids
    (``vision.image_token_ids``), ``grids``: each image's (temporal, height, width) patch grid
    by key, as its processor gave it (``image_grid_thw``), ``merge``: the patches merged into
    one token along height and width (``spatial_merge_size``)."""
    n = len(tokens)
    out = np.empty((3, n), dtype=np.int64)
    next_pos = i = 0
    while i < n:
        if tokens[i] >= 0:
            out[:, i] = next_pos
            next_pos += 1
            i += 1
            continue
        key, j = split_image_token(tokens[i])
        if key not in grids or j != 0:
            raise ValueError("a prompt's image tokens do not match its images")
        t, h, w = grids[key][0], grids[key][1] // merge, grids[key][2] // merge
        size = t * h * w
        grid = np.stack([a.ravel() for a in np.meshgrid(np.arange(t), np.arange(h),
                                                          np.arange(w), indexing="ij")])
        out[:, i:i + size] = grid[:, :n - i] + next_pos
        next_pos += max(t, h, w)
        i += size
    return Placement(out, next_pos - n)


def _selector(sections: list[int], interleaved: bool) -> np.ndarray:
    """Which of the three positions each of the head's frequencies turns by (mlx-vlm's
    position selectors): contiguous sections, or (``interleaved``) height and width taking
    every third frequency from the second and third, up to three times their sections."""
    if not interleaved:
        return np.repeat(np.arange(3), sections)
    out = np.zeros(sum(sections), dtype=np.int64)
    for axis in (1, 2):
        out[axis:min(3 * sections[axis], len(out)):3] = axis
    return out


def _spatial_rope(x: mx.array, positions: mx.array, inv_freq: mx.array, selector: mx.array
                  ) -> mx.array:
    """``x`` [B, heads, L, D] rotated by three position ids a token (``positions``
    [3, B, L]): frequency k by the position ``selector[k]`` names (mlx-vlm's M-RoPE, its
    non-fused path: angles in float32, cos and sin in ``x``'s type)."""
    angles = mx.moveaxis(positions.astype(mx.float32)[selector], 0, -1) * inv_freq
    emb = mx.concatenate([angles, angles], axis=-1)
    cos = mx.cos(emb).astype(x.dtype)[:, None]
    sin = mx.sin(emb).astype(x.dtype)[:, None]
    # A partial rotary embedding (Qwen3.5's) turns the head's first dims and keeps the rest.
    dims = emb.shape[-1]
    part, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = mx.concatenate([-part[..., half:], part[..., :half]], axis=-1)
    out = (part * cos + rotated * sin).astype(x.dtype)
    return out if rest.shape[-1] == 0 else mx.concatenate([out, rest], axis=-1)


class _PlacedRope(nn.Module):
    """An attention layer's rope under ``MRoPE``: mlx-lm's own unless the call is placed."""

    def __init__(self, rope: nn.RoPE, owner: MRoPE) -> None:
        super().__init__()
        self.rope = rope
        self.owner = owner  # not a module: its state is per call, never a parameter

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        m = self.owner
        if m.shift is None:
            return self.rope(x, offset=offset)
        out = self.rope(x, offset=offset + m.shift)
        if m.positions is None:
            return out
        spatial = _spatial_rope(x, m.positions, m.inv_freq, m.selector)
        return mx.where(m.spatial[:, None, None, None], spatial, out)


class MRoPE:
    """M-RoPE installed on a Qwen-VL checkpoint's text model (mlx-lm's): each attention
    layer's rope wrapped, reading the placement the runner gives a call (``placed``)."""

    def __init__(self, model: Any, config: dict) -> None:
        text = config.get("text_config") or config
        scaling = (text.get("rope_scaling") or text.get("rope_parameters")
                   or config.get("rope_scaling") or {})
        sections = list(scaling.get("mrope_section") or [])
        self.merge = int(config["vision_config"].get("spatial_merge_size", 2))
        # Attention layers only (Qwen3.5's linear-attention layers take no positions).
        attentions = [layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")]
        rope = attentions[0].rope
        if (type(rope) is not nn.RoPE or rope.traditional or rope.scale != 1.0
                or len(sections) != 3 or 2 * sum(sections) != rope.dims):
            raise ValueError("this checkpoint's rotary embedding is not the M-RoPE troupe "
                             "places images by")
        self.inv_freq = 1.0 / (rope.base ** (mx.arange(0, rope.dims, 2, dtype=mx.float32)
                                             / rope.dims))
        self.selector = mx.array(_selector(sections, MROPE_MODEL_TYPES[config["model_type"]]))
        self.shift: mx.array | None = None
        self.positions: mx.array | None = None
        self.spatial: mx.array | None = None
        for attention in attentions:
            attention.rope = _PlacedRope(attention.rope, self)

    def place(self, tokens: Sequence[int], images: Mapping[int, Any]) -> Placement:
        """A prompt's placement, ``images``: its images (``ImageInput``) by key."""
        return place(tokens, {k: tuple(i.grid) for k, i in images.items()}, self.merge)

    @contextmanager
    def placed(self, shift: list[int], positions: np.ndarray | None = None,
               spatial: list[bool] | None = None) -> Iterator[None]:
        """The model calls inside rotate row b at its cache offset + ``shift[b]``, and the
        rows ``spatial`` names by ``positions`` [3, rows, tokens] instead."""
        self.shift = mx.array(shift)
        if positions is not None:
            self.positions = mx.array(positions)
            self.spatial = mx.array(spatial)
        try:
            yield
        finally:
            self.shift = self.positions = self.spatial = None
