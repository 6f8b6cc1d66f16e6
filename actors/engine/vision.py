"""Images in a prompt, on the MLX thread: a vision-language checkpoint's vision tower and
projector (mlx-vlm's classes, the optional extra ``mlx-troupe[vision]``) turn an image's pixels
into the embeddings of its tokens; the language model (mlx-lm's, as for text) reads them in
place of those tokens' embeddings, in troupe's own step.

A prompt's image tokens are carried as negative ids (``image_token_ids``): each names its
image's key (a hash of its processed pixels) and its place in the image, so the prefix cache's
block names, which hash token ids, tell one image from another and the same image sent again is
a hit, across restarts too. The runner turns them back into the model's image token, whose
embedding these features replace, before anything reaches the model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from troupe.actors.engine.deepstack import Deepstack

# The families whose images troupe reads, checked against mlx-vlm's own generation in
# tests/test_vision.py: Gemma 3 places an image's tokens at 1-D positions, as text; Qwen2-VL
# and Qwen2.5-VL by M-RoPE (three position ids a token, ``actors.engine.mrope``), Qwen3-VL
# too, its tower also feeding the first layers (``actors.engine.deepstack``), and Qwen3.5 (its
# linear-attention layers take no positions); the mixtures of experts of the last two alike.
# Mistral 3 (Mistral Small 3.1 and later) and Pixtral at 1-D positions too: their Pixtral
# tower reads an image at the image's own size, into rows of tokens with a break token between.
VISION_MODEL_TYPES = frozenset({"gemma3", "mistral3", "pixtral", "qwen2_vl", "qwen2_5_vl",
                                "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
EXTRA = "pip install 'mlx-troupe[vision]'"
# The mlx-vlm versions the tests ran on (pyproject.toml pins the extra to them).
TESTED_MLX_VLM = ("0.7.10",)
# An image token's id: -(key << OFFSET_BITS | offset) - 1, a key of KEY_BITS bits.
OFFSET_BITS = 20
KEY_BITS = 40


def vision_config(model_dir: Path) -> dict | None:
    """The checkpoint's config when it is a vision-language model (a ``vision_config``), else
    None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config.get("vision_config"), dict) else None


def why_no_images(model_dir: Path) -> str | None:
    """Why this model cannot read images (None: it can)."""
    config = vision_config(model_dir)
    if config is None:
        return "it is a text-only model"
    kind = config.get("model_type")
    if kind not in VISION_MODEL_TYPES:
        return (f"images are read for the {', '.join(sorted(VISION_MODEL_TYPES))} families; "
                f"this model's ({kind}) is served on text alone")
    try:
        version = importlib.metadata.version("mlx-vlm")
    except importlib.metadata.PackageNotFoundError:
        return f"the vision extra is not installed ({EXTRA})"
    if version not in TESTED_MLX_VLM:
        return f"mlx-vlm {version} is not a version troupe was tested with ({EXTRA})"
    return None


def image_key(pixels: np.ndarray, grid: tuple[int, int, int] | None = None) -> int:
    """An image's key: a hash of its processed pixels (the processor's settings are in them:
    size, crop, normalisation), its shape and type, and its patch grid when its pixels are
    rows of patches (the Qwen-VL family's)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{pixels.dtype}|{pixels.shape}|".encode())
    if grid is not None:
        h.update(f"{tuple(grid)}|".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return int.from_bytes(h.digest(), "big") >> (64 - KEY_BITS)


def image_token_ids(key: int, n: int) -> list[int]:
    """The ids of an image's ``n`` tokens in a prompt (negative: never a vocabulary id)."""
    if n >= 1 << OFFSET_BITS:
        raise ValueError(f"an image of {n} tokens is more than one prompt can place")
    return [-((key << OFFSET_BITS) | j) - 1 for j in range(n)]


def split_image_token(token: int) -> tuple[int, int]:
    """An image token's key and its place in the image."""
    value = -token - 1
    return value >> OFFSET_BITS, value & ((1 << OFFSET_BITS) - 1)


class _TextEmbedding(nn.Module):
    """Stands in for mlx-vlm's copy of the language model, of which its merge reads only the
    token embedding: the served model's own (the copy's weights are never loaded)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = embed_tokens

    def get_rope_index(self, *args: Any, **kwargs: Any) -> tuple[None, None]:
        """The Qwen-VL merge also asks for the prompt's M-RoPE positions: troupe places its
        prompts itself (``actors.engine.mrope``)."""
        return None, None


def embedding_layer(model: Any) -> nn.Module:
    """The language model's token embedding (a multimodal checkpoint's text model keeps it
    under ``language_model``)."""
    inner = getattr(model, "language_model", model)
    return inner.model.embed_tokens


class VisionTower:
    """A vision-language checkpoint's vision tower and projector, loaded beside its language
    model (``model``, mlx-lm's). Runs on the MLX thread only."""

    def __init__(self, model_dir: Path, model: Any) -> None:
        from mlx_vlm.utils import load_model

        # Imported here: mrope reads this module's image ids.
        from troupe.actors.engine.mrope import MROPE_MODEL_TYPES, MRoPE

        self.config = vision_config(model_dir) or {}
        self.image_token = int(self.config.get("image_token_index",
                                               self.config.get("image_token_id", -1)))
        # Lazily: the copy's language model is replaced before any of its weights is read.
        vlm = load_model(Path(model_dir), lazy=True)
        vlm.language_model = _TextEmbedding(embedding_layer(model))
        mx.eval(vlm.parameters())
        self.vlm = vlm
        self.embed = embedding_layer(model)
        # The Qwen-VL family's positions (None: images at 1-D positions, as text).
        self.mrope = (MRoPE(model, self.config)
                      if self.config.get("model_type") in MROPE_MODEL_TYPES else None)
        # Qwen3-VL's features for its first layers (None: the tower feeds the input alone).
        levels = len(self.config["vision_config"].get("deepstack_visual_indexes") or [])
        self.deepstack = Deepstack(model, levels) if levels else None
        # Pixtral's tower reads each image at its own size, which it is told.
        self.sized = self.config["vision_config"].get("model_type") == "pixtral"

    def features(self, image: Any) -> mx.array:
        """The embeddings of an image's tokens (``image``: an ``ImageInput``, its pixels as its
        processor made them), as the model's own merge places them: [tokens, 1 + levels,
        hidden], the input's, then what each deepstack layer adds (``deepstack``)."""
        n = image.tokens
        ids = mx.full((1, n), self.image_token, dtype=mx.int32)
        pixels = mx.array(image.pixels)
        if image.grid is None:
            extra = ({"image_sizes": mx.array([list(image.pixels.shape[-2:])])}
                     if self.sized else {})
            pixels = pixels[None]
        else:  # rows of patches, their grid the tower's to know
            extra = {"image_grid_thw": mx.array([list(image.grid)])}
        out = self.vlm.get_input_embeddings(ids, pixels, mask=mx.ones((1, n)), **extra)
        rows = out.inputs_embeds[0][:, None]
        if self.deepstack is not None:
            deep = mx.stack(list(out.deepstack_visual_embeds), axis=1)
            rows = mx.concatenate([rows, deep.astype(rows.dtype)], axis=1)
        mx.eval(rows)
        return rows
