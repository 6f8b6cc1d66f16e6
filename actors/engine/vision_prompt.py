"""A chat's images, in admission's worker threads: the model's processor (mlx-vlm's, with its
Hugging Face image processor) sizes and normalises each image and writes its tokens into the
rendered prompt; each image's tokens then carry its key (``actors.engine.vision``), and its
processed pixels go to the scheduler, whose thread alone runs the vision tower."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from troupe.actors.engine.vision import image_key, image_token_ids, vision_config
from troupe.actors.messages import ImageInput


def load_processor(model_dir: Path) -> Any:
    """The checkpoint's processor (tokenizer and image processor), as mlx-vlm loads it."""
    from mlx_vlm.utils import load_processor as vlm_processor

    return vlm_processor(str(model_dir), add_detokenizer=False)


def image_token(model_dir: Path) -> int:
    """The id the processor writes for each of an image's tokens."""
    config = vision_config(model_dir) or {}
    return int(config.get("image_token_index", config.get("image_token_id", -1)))


def with_images(processor: Any, token: int, text: str, images: list[Any]
                ) -> tuple[list[int], list[ImageInput]]:
    """The rendered chat ``text`` (one image marker per image, as the chat template writes
    them) with each of ``images`` (PIL images, in order) in it: the prompt's token ids, each
    image's ``token`` ids replaced by ids that carry its key, and the images as the
    scheduler takes them."""
    out = processor(text=[text], images=images, add_special_tokens=False)
    ids = np.asarray(out["input_ids"]).reshape(-1).tolist()
    pixels = np.asarray(out["pixel_values"], dtype=np.float32)
    grids: list[tuple[int, int, int] | None] = [None] * len(images)
    per_image = list(pixels)
    if out.get("image_grid_thw") is not None:
        # The Qwen-VL family's pixels: every image's patches, one row each, one after another.
        grids = [(int(t), int(h), int(w)) for t, h, w in np.asarray(out["image_grid_thw"])]
        ends = np.cumsum([t * h * w for t, h, w in grids])[:-1]
        per_image = np.split(pixels, ends)
    elif out.get("image_sizes") is not None:
        # Pixtral's (Mistral 3's): each image at its own size, padded to the largest given;
        # cut back, so an image's key and its tower's input do not depend on its companions.
        per_image = [p[:, :int(h), :int(w)] for p, (h, w)
                     in zip(pixels, np.asarray(out["image_sizes"]), strict=True)]
    runs = _images(ids, token, getattr(processor, "image_break_token_id", None))
    if len(runs) != len(images) or len(per_image) != len(images):
        raise ValueError(f"the processor placed {len(runs)} images for the {len(images)} given")
    inputs = []
    for places, image_pixels, grid in zip(runs, per_image, grids, strict=True):
        key = image_key(image_pixels, grid)
        for place, token_id in zip(places, image_token_ids(key, len(places)), strict=True):
            ids[place] = token_id
        inputs.append(ImageInput(key=key, tokens=len(places), pixels=image_pixels, grid=grid))
    return ids, inputs


def _images(ids: list[int], token: int, row_break: int | None) -> list[list[int]]:
    """Where each image's tokens are in ``ids``: its run of ``token``, or, where the
    processor writes a ``row_break`` token between an image's rows of ``token`` (Pixtral's
    ``[IMG_BREAK]``), its runs joined across them (the breaks stay text)."""
    images: list[list[int]] = []
    for start, n in _runs(ids, token):
        joined = (images and row_break is not None and start >= 2
                  and ids[start - 1] == row_break and images[-1][-1] == start - 2)
        if joined:
            images[-1].extend(range(start, start + n))
        else:
            images.append(list(range(start, start + n)))
    return images


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """Where each run of ``token`` starts in ``ids``, and its length."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
