"""Images through troupe's engine (actors/engine/vision.py, actors/engine/vision_prompt.py): a tiny
random-weight Gemma 3 vision-language checkpoint made with mlx-vlm's own classes
(tests/tiny_vlm.py), its processor, tower and projector mlx-vlm's, its language model mlx-lm's
in troupe's step. Every answer is checked against mlx-vlm's own generation of the same prompt
and image: alone, four at once, beside text requests, and from the prefix cache (RAM, and
files after a restart); a different image with the same text is never a hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_helpers import engine_config, greedy, ram_hit, run
from mlx_lm import load
from PIL import Image
from tiny_vlm import (
    make_tiny_gemma3_vlm,
    make_tiny_mistral3,
    make_tiny_pixtral,
    make_tiny_qwen2_5_vl,
    make_tiny_qwen2_vl,
    make_tiny_qwen3_5,
    make_tiny_qwen3_5_moe,
    make_tiny_qwen3_vl,
    make_tiny_qwen3_vl_moe,
)

from troupe.actors import block_store
from troupe.actors.engine import runner
from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import from_numpy, to_numpy
from troupe.actors.engine.prefix import model_fingerprint
from troupe.actors.engine.speculate import Drafter
from troupe.actors.engine.vision import (
    VisionTower,
    image_token_ids,
    split_image_token,
    why_no_images,
)
from troupe.actors.engine.vision_prompt import image_token, load_processor, with_images
from troupe.actors.messages import ImageInput

mlx_vlm = pytest.importorskip("mlx_vlm")  # the vision extra; `make setup` installs it

QUESTION = "What is in this picture? Describe the colours, the shapes and the mood of it."


def picture(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8"))


def chat(n_images: int = 1, text: str = QUESTION) -> list[dict]:
    return [{"role": "user",
             "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


# Each family troupe reads images for: Gemma 3 (an image's tokens at 1-D positions), Mistral 3
# and Pixtral (1-D too; a Pixtral tower at the image's own size, a break token between rows of
# tokens; Mistral 3 merges 2x2 patches),
# Qwen2-VL and Qwen2.5-VL (M-RoPE, actors/engine/mrope.py), Qwen3-VL and its mixture of
# experts (interleaved M-RoPE, and deepstack: actors/engine/deepstack.py), Qwen3.5 and its
# mixture of experts (interleaved M-RoPE on half of each head, linear-attention layers between).
MAKERS = {"gemma3": make_tiny_gemma3_vlm, "mistral3": make_tiny_mistral3,
          "pixtral": make_tiny_pixtral,
          "qwen2_vl": make_tiny_qwen2_vl, "qwen2_5_vl": make_tiny_qwen2_5_vl,
          "qwen3_vl": make_tiny_qwen3_vl,
          "qwen3_vl_moe": make_tiny_qwen3_vl_moe, "qwen3_5": make_tiny_qwen3_5,
          "qwen3_5_moe": make_tiny_qwen3_5_moe}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model_dir = MAKERS[request.param](tmp_path_factory.mktemp(request.param) / request.param)
    model, tok = load(str(model_dir))
    tower = VisionTower(model_dir, model)
    processor = load_processor(model_dir)
    reference_model, _ = mlx_vlm.load(str(model_dir))
    return model_dir, model, tok, tower, processor, reference_model


def rendered(vlm: Any, messages: list[dict]) -> str:
    tok = vlm[2]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt(vlm: Any, images: list[Image.Image], text: str = QUESTION
           ) -> tuple[list[int], dict[int, Any]]:
    model_dir, _, _, _, processor, _ = vlm
    ids, inputs = with_images(processor, image_token(model_dir), rendered(vlm, chat(len(images),
                              text)), images)
    return ids, {i.key: i for i in inputs}


def reference(vlm: Any, images: list[Image.Image], text: str = QUESTION,
              max_tokens: int = 16) -> list[int]:
    """mlx-vlm's own greedy generation of the prompt and images."""
    from mlx_vlm.generate.ar import generate_step

    _, _, _, _, processor, model = vlm
    out = processor(text=[rendered(vlm, chat(len(images), text))], images=images,
                    add_special_tokens=False)
    extra = {k: out[k] for k in ("image_grid_thw", "image_sizes") if k in out}
    steps = generate_step(out["input_ids"], model, out["pixel_values"], out["attention_mask"],
                          max_tokens=max_tokens, temperature=0.0, **extra)
    return [int(t) for (t, _), _ in zip(steps, range(max_tokens), strict=False)]


def engine(vlm: Any, **settings: Any) -> Engine:
    model_dir, model, tok, tower, _, _ = vlm
    return Engine(model, tok, engine_config(**settings), vision=tower,
                  fingerprint=model_fingerprint(model_dir))


def serve(e: Engine, rid: str, ids: list[int], images: dict[int, Any], cached: Any = (),
          max_tokens: int = 16) -> tuple[list[int], int]:
    e.add(rid, ids, greedy(max_tokens, ignore_eos=True), cached=cached, images=images)
    res = run(e)[rid]
    return res["tokens"], res["finish"].usage.cached_tokens


def test_the_model_reads_images_and_two_images_answer_differently(vlm: Any) -> None:
    assert why_no_images(vlm[0]) is None
    a, b = reference(vlm, [picture(0)]), reference(vlm, [picture(1)])
    assert a != b, "the tiny model must see its image for the equalities below to mean much"


def test_an_image_prompt_answers_as_mlx_vlm_does(vlm: Any) -> None:
    for seed in (0, 1):
        ids, images = prompt(vlm, [picture(seed)])
        assert serve(engine(vlm), "a", ids, images)[0] == reference(vlm, [picture(seed)])


def test_two_images_in_one_prompt_answer_as_mlx_vlm_does(vlm: Any) -> None:
    pics = [picture(2), picture(3, (64, 20))]
    ids, images = prompt(vlm, pics)
    assert len(images) == 2
    assert serve(engine(vlm), "a", ids, images)[0] == reference(vlm, pics)


def test_an_image_s_key_and_pixels_do_not_depend_on_the_images_beside_it(vlm: Any) -> None:
    """Pixtral's processor pads every image of a prompt to the largest: each is cut back, so
    the same screenshot beside another image is still the same cache key."""
    small = picture(3, (64, 20))
    (_, alone), = prompt(vlm, [small])[1].items()
    beside = list(prompt(vlm, [picture(2), small])[1].values())[1]
    assert beside.key == alone.key and beside.tokens == alone.tokens
    assert np.array_equal(beside.pixels, alone.pixels)


@pytest.mark.parametrize("split", ["inside the image", "in chunks of 3"])
def test_an_image_split_across_prefill_chunks_answers_the_same(vlm: Any, split: str) -> None:
    ids, images = prompt(vlm, [picture(0)])
    first = next(i for i, t in enumerate(ids) if t < 0)
    # A chunk that ends inside the image's tokens; or chunks of text alone before and after
    # the image (M-RoPE: the text after it goes on from the image's positions).
    e = engine(vlm, prefill_step_size=first + 2 if split == "inside the image" else 3)
    assert serve(e, "a", ids, images)[0] == reference(vlm, [picture(0)])


@pytest.mark.parametrize("ending", ["right", "wrong"])
def test_drafts_verified_on_an_image_prompt_answer_as_mlx_vlm_does(
        vlm: Any, monkeypatch: pytest.MonkeyPatch, ending: str) -> None:
    """Drafts of mlx-vlm's own answer, whole or with a wrong last token (rejected: the
    positions it ran leave the cache, and a hybrid's recurrent state goes back)."""
    ids, images = prompt(vlm, [picture(5)])
    want = reference(vlm, [picture(5)], max_tokens=24)

    class Foreseeing(Drafter):
        """Drafts mlx-vlm's own answer: every draft is verified at the positions the
        answer's tokens sit at (past the image: M-RoPE's), and kept only if they are right."""

        seen = 0

        def sync(self, tokens: list[int], more: Sequence[int] = ()) -> None:
            super().sync(tokens, more)
            self.seen = len(tokens) + len(more)

        def draft(self, last: int, most: int) -> list[int]:
            answered = self.seen + 1 - len(ids)  # ``last``, the next input, is answered
            draft = want[answered:answered + min(most, 4)]
            if ending == "wrong" and draft:
                draft[-1] = (draft[-1] + 1) % 100
            return draft

    monkeypatch.setattr(runner, "Drafter", Foreseeing)
    e = engine(vlm, speculative="ngram")
    assert serve(e, "a", ids, images, max_tokens=24)[0] == want
    if ending == "right":
        assert e.runner.drafts > 0 and e.runner.accepted == e.runner.drafted
    else:
        assert 0 < e.runner.accepted < e.runner.drafted
        assert (e.runner.restored > 0) == vlm[0].name.startswith("qwen3_5")


def test_four_image_prompts_at_once_and_beside_text_answer_as_alone(vlm: Any) -> None:
    _, _, tok, _, _, _ = vlm
    e = engine(vlm)
    want = {}
    for i in range(4):
        ids, images = prompt(vlm, [picture(10 + i)], QUESTION[: 30 + 7 * i])
        e.add(f"img{i}", ids, greedy(16, ignore_eos=True), images=images)
        want[f"img{i}"] = reference(vlm, [picture(10 + i)], QUESTION[: 30 + 7 * i])
    text = tok.encode(rendered(vlm, [{"role": "user", "content": "Hello there, who are you?"}]),
                      add_special_tokens=False)
    e.add("text", text, greedy(16, ignore_eos=True))
    got = run(e)
    assert {k: got[k]["tokens"] for k in want} == want
    alone = engine(vlm)
    alone.add("text", text, greedy(16, ignore_eos=True))
    assert got["text"]["tokens"] == run(alone)["text"]["tokens"]


def test_the_same_image_again_is_a_ram_hit_with_the_same_answer(vlm: Any) -> None:
    e = engine(vlm, block_size=4)
    ids, images = prompt(vlm, [picture(0)])
    want = reference(vlm, [picture(0)])
    assert serve(e, "cold", ids, images) == (want, 0)
    hit = ram_hit(e, ids)
    got, cached = serve(e, "warm", ids, images, hit)
    assert got == want and cached >= len(ids) - 4


def test_a_different_image_with_the_same_text_is_never_a_hit(vlm: Any) -> None:
    e = engine(vlm, block_size=4)
    ids, images = prompt(vlm, [picture(0)])
    serve(e, "first", ids, images)
    other, other_images = prompt(vlm, [picture(1)])
    first_image = next(i for i, t in enumerate(other) if t < 0)
    hit = ram_hit(e, other)
    # Only the blocks wholly before the image are shared.
    assert len(hit) * 4 <= first_image
    got, cached = serve(e, "second", other, other_images, hit)
    assert got == reference(vlm, [picture(1)]) and cached <= first_image


def test_image_blocks_through_files_serve_a_restarted_engine(vlm: Any, tmp_path: Path) -> None:
    model_dir = vlm[0]
    fingerprint = model_fingerprint(model_dir)
    ids, images = prompt(vlm, [picture(4)])
    want = reference(vlm, [picture(4)])
    first = engine(vlm, block_size=4)
    assert serve(first, "cold", ids, images)[0] == want
    for _, blk in first.take_new_blocks():
        if not blk.tail:
            block_store.write_atomic(block_store.block_path(tmp_path, blk.block_hash),
                                     block_store.encode_block(to_numpy(blk, first.layout),
                                                              fingerprint),
                                     block_store.fingerprint_tag(fingerprint))
    model, tok = load(str(model_dir))
    restarted = Engine(model, tok, engine_config(block_size=4),
                       vision=VisionTower(model_dir, model), fingerprint=fingerprint)
    # The keys come from the pixels, so a new process names the image's blocks alike.
    again, again_images = prompt(vlm, [picture(4)])
    assert again == ids
    hit = []
    for h in restarted.prompt_hashes(again):
        path = block_store.block_path(tmp_path, h)
        if not path.exists():
            break
        hit.append(from_numpy(block_store.decode_block(path.read_bytes(), fingerprint, h),
                              restarted.kinds, restarted.state_sizes, restarted.layout))
    got, cached = serve(restarted, "warm", again, again_images, hit)
    assert got == want and cached >= len(ids) - 8


def test_m_rope_positions_are_mlx_vlm_s(vlm: Any) -> None:
    model_dir, _, tok, tower, processor, reference_model = vlm
    if tower.mrope is None:
        pytest.skip("this family places images at 1-D positions")
    pics = [picture(2), picture(3, (64, 20)), picture(4, (20, 64))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                             {"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]
    text = rendered(vlm, messages)
    ids, inputs = with_images(processor, image_token(model_dir), text, pics)
    assert len({i.grid for i in inputs}) == 3, "grids of three shapes, rows unlike columns"
    placement = tower.mrope.place(ids, {i.key: i for i in inputs})
    out = processor(text=[text], images=pics, add_special_tokens=False)
    want, delta = reference_model.language_model.get_rope_index(out["input_ids"],
                                                                out["image_grid_thw"])
    assert placement.positions.tolist() == np.asarray(want)[:, 0].tolist()
    assert placement.delta == int(np.asarray(delta).item()) < 0
    # Past the prompt, text at its index + delta; a chunk reads the table and goes on.
    n = len(ids)
    assert placement.chunk(n - 2, 4).tolist() == [
        [*np.asarray(want)[d, 0, -2:].tolist(), n + delta, n + 1 + delta] for d in range(3)]


def test_image_token_ids_carry_the_key_and_the_place() -> None:
    ids = image_token_ids(123456789, 5)
    assert all(t < 0 for t in ids)
    assert [split_image_token(t) for t in ids] == [(123456789, j) for j in range(5)]


def test_a_text_only_model_reads_no_images(tiny_model_dir: Path) -> None:
    assert "text-only" in (why_no_images(tiny_model_dir) or "")
    model, tok = load(str(tiny_model_dir))
    e = Engine(model, tok, engine_config())
    with pytest.raises(Exception, match="no images"):
        e.add("a", [1, 2, *image_token_ids(7, 2), 3], greedy(4),
              images={7: ImageInput(key=7, tokens=2, pixels=None)})



def test_an_untested_mlx_vlm_reads_no_images(vlm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
    assert "not a version troupe was tested with" in (why_no_images(vlm[0]) or "")


def test_without_the_vision_extra_a_vlm_reads_no_images_and_says_which_extra(
        vlm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "pip install 'mlx-troupe[vision]'" in (why_no_images(vlm[0]) or "")
