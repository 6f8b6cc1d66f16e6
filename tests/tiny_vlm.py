"""Tiny random-weight vision-language model directories, made in the test run with mlx-vlm's
own classes: a Gemma 3 (SigLIP tower, pooled projector) with a real BPE tokenizer, an image
processor config and a chat template that writes image parts, so that images go through the
same processor, tower and template code as a downloaded checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny_model import write_tokenizer

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"

# ChatML whose user turns may be content lists: text parts as text, image parts as the
# begin-of-image marker the processor expands into the image's tokens (Gemma 3's convention).
VLM_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + BOI + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def save_random(out: Path, model: Any, config: dict, head: str | None = None) -> None:
    """Write ``model``'s weights, drawn wider than the default initialisation (varied greedy
    output, and an image's features that reach the answer), and ``config`` to ``out``;
    ``head``: the weight the text model's output head is tied to."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    weights = {k: (mx.random.normal(v.shape) * 2.0 / v.shape[-1] ** 0.5 if v.ndim >= 2
                   and "norm" not in k else v) for k, v in weights.items()}
    if head is not None:
        weights["language_model.lm_head.weight"] = weights[head]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def make_tiny_gemma3_vlm(out: Path, *, hidden: int = 64, layers: int = 4, image_size: int = 32,
                         patch: int = 8, image_tokens: int = 16, seed: int = 0,
                         heads: int = 4, kv_heads: int = 2, vision_hidden: int = 32,
                         vision_layers: int = 2, vision_heads: int = 2) -> Path:
    """Write a random-weight Gemma 3 vision-language checkpoint to ``out`` (the defaults:
    the tests' tiny one; benchmarks/bench_vision.py makes a larger one)."""
    import mlx.core as mx
    from mlx_vlm.models.gemma3 import Model
    from mlx_vlm.models.gemma3.config import ModelConfig, TextConfig, VisionConfig
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, template=VLM_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": [BOI, IMAGE, EOI]})
    tok.save_pretrained(str(out))
    vocab = len(tok)
    config_file = out / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    # Gemma's tokenizer names these tokens; its processor reads them by these names.
    tok_config["extra_special_tokens"] = {"boi_token": BOI, "image_token": IMAGE,
                                          "eoi_token": EOI}
    tok_config["chat_template"] = VLM_TEMPLATE
    config_file.write_text(json.dumps(tok_config, indent=2))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOI, IMAGE, EOI)}
    text = {
        "model_type": "gemma3_text", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": hidden * 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "query_pre_attn_scalar": hidden // heads, "rms_norm_eps": 1e-6,
        "vocab_size": vocab, "sliding_window": 18, "sliding_window_pattern": 2,
        "mm_tokens_per_image": image_tokens, "max_position_embeddings": 2048,
        "rope_global_base_freq": 1000000.0, "rope_local_base_freq": 10000.0,
    }
    vision = {
        "model_type": "siglip_vision_model", "hidden_size": vision_hidden,
        "num_hidden_layers": vision_layers, "intermediate_size": vision_hidden * 2,
        "num_attention_heads": vision_heads, "patch_size": patch,
        "image_size": image_size, "layer_norm_eps": 1e-6,
    }
    config = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": vision, "hidden_size": hidden,
        "vocab_size": vocab, "image_token_index": ids[IMAGE], "boi_token_index": ids[BOI],
        "eoi_token_index": ids[EOI], "mm_tokens_per_image": image_tokens,
        "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
    }
    mx.random.seed(seed)
    model_config = ModelConfig.from_dict(config)
    model_config.text_config = TextConfig.from_dict(text)
    model_config.vision_config = VisionConfig.from_dict(vision)
    # Gemma 3 ties its output head to the embedding (mlx-lm's text model reads no head).
    save_random(out, Model(model_config), config,
                head="language_model.model.embed_tokens.weight")
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "do_resize": True, "size": {"height": image_size, "width": image_size},
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
        "do_pan_and_scan": False,
    }, indent=2))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": image_tokens}))
    return out


VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = (
    "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# ChatML writing image parts as Qwen-VL's templates do: the image pad between the vision
# markers, which the processor expands into the image's tokens.
QWEN_VL_TEMPLATE = VLM_TEMPLATE.replace(BOI, VISION_START + IMAGE_PAD + VISION_END)


def make_tiny_qwen2_5_vl(out: Path, **kw: Any) -> Path:
    """Write a random-weight Qwen2.5-VL checkpoint to ``out`` (``make_tiny_qwen_vl``)."""
    return make_tiny_qwen_vl(out, "qwen2_5_vl", **kw)


def make_tiny_qwen2_vl(out: Path, **kw: Any) -> Path:
    """Write a random-weight Qwen2-VL checkpoint to ``out`` (``make_tiny_qwen_vl``)."""
    return make_tiny_qwen_vl(out, "qwen2_vl", **kw)


def make_tiny_qwen3_vl(out: Path, **kw: Any) -> Path:
    """Write a random-weight Qwen3-VL checkpoint to ``out`` (``make_tiny_qwen_vl``)."""
    return make_tiny_qwen_vl(out, "qwen3_vl", **kw)


def make_tiny_qwen3_vl_moe(out: Path, **kw: Any) -> Path:
    """Write a random-weight Qwen3-VL mixture of experts (four experts, two a token) to
    ``out`` (``make_tiny_qwen_vl``)."""
    return make_tiny_qwen_vl(out, "qwen3_vl_moe", **kw)


def make_tiny_qwen3_5(out: Path, **kw: Any) -> Path:
    """Write a random-weight Qwen3.5 checkpoint to ``out`` (``make_tiny_qwen_vl``): every
    second layer linear attention, the others rotating half of each head."""
    return make_tiny_qwen_vl(out, "qwen3_5", **kw)


def make_tiny_qwen3_5_moe(out: Path, **kw: Any) -> Path:
    """Write a random-weight Qwen3.5 mixture of experts (four experts, two a token, and a
    shared one) to ``out`` (``make_tiny_qwen_vl``)."""
    return make_tiny_qwen_vl(out, "qwen3_5_moe", **kw)


# The processor classes' names of each family.
QWEN_VL_NAMES = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL",
                 "qwen3_vl_moe": "Qwen3VLMoe", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}


def make_tiny_qwen_vl(out: Path, kind: str, *, hidden: int = 64, layers: int = 4,
                      patch: int = 8, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of the Qwen-VL family ``kind`` (a ``model_type``) to
    ``out``, made with mlx-vlm's classes: M-RoPE (Qwen3-VL's and Qwen3.5's interleaved),
    Qwen3-VL's tower also feeding the first layer (deepstack). Its image processor sizes an
    image to at most 48x48 pixels (a grid of at most 6x6 patches of 8, 9 tokens once 2x2 are
    merged), keeping its aspect ratio, so images of other shapes take other grids."""
    import importlib

    import mlx.core as mx
    from transformers import AutoTokenizer

    family = importlib.import_module(f"mlx_vlm.models.{kind}")
    configs = importlib.import_module(f"mlx_vlm.models.{kind}.config")
    name = QWEN_VL_NAMES[kind]

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, template=QWEN_VL_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END,
                                                          VIDEO_PAD]})
    tok.save_pretrained(str(out))
    config_file = out / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config["chat_template"] = QWEN_VL_TEMPLATE
    config_file.write_text(json.dumps(tok_config, indent=2))
    ids = {t: tok.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END,
                                                     VIDEO_PAD)}
    text = {
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": hidden * 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "vocab_size": len(tok), "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        # M-RoPE's sections (temporal, height, width) share the head's 8 frequencies.
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    elif kind in ("qwen3_vl", "qwen3_vl_moe"):
        text |= {"model_type": "qwen3_vl_text", "head_dim": 16,
                 "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                  "mrope_interleaved": True}}
    else:  # Qwen3.5: linear attention every second layer, half of each head rotated
        # (a small base, so that its few rotated frequencies all turn enough with position
        # for the answers to tell wrong positions)
        text |= {"model_type": f"{kind}_text", "head_dim": 32, "full_attention_interval": 2,
                 "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                 "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                 "linear_conv_kernel_dim": 4,
                 "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                     "mrope_interleaved": True, "rope_theta": 100.0,
                                     "partial_rotary_factor": 0.5}}
    if kind == "qwen3_vl_moe":
        # mlx-lm's mixture of experts reads an output head of its own.
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "moe_intermediate_size": hidden, "norm_topk_prob": True,
                 "tie_word_embeddings": False}
    if kind == "qwen3_5_moe":
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
                 "shared_expert_intermediate_size": hidden}
    vision = {
        "model_type": kind, "depth": 2, "num_heads": 2, "patch_size": patch,
        "spatial_patch_size": patch, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "in_channels": 3,
    }
    if kind == "qwen2_vl":
        vision |= {"embed_dim": 32, "hidden_size": hidden, "mlp_ratio": 2}
    else:
        vision |= {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": hidden}
    if kind == "qwen2_5_vl":  # its tower attends in windows, one block of two in full
        vision |= {"window_size": patch * 4, "fullatt_block_indexes": [1]}
    if kind not in ("qwen2_vl", "qwen2_5_vl"):
        vision |= {"num_position_embeddings": 36}
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        vision |= {"deepstack_visual_indexes": [0]}
    config = {
        "model_type": kind, "architectures": [f"{name}ForConditionalGeneration"],
        "vision_config": vision, "tie_word_embeddings": text["tie_word_embeddings"],
        "image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END],
        "eos_token_id": tok.eos_token_id,
    }
    mx.random.seed(seed)
    if kind in ("qwen2_vl", "qwen2_5_vl"):  # their text settings at the top level
        config |= text
        model_config = configs.ModelConfig.from_dict(dict(config))
        model_config.vision_config = configs.VisionConfig.from_dict(vision)
        model_config.text_config = configs.TextConfig.from_dict(text | {"model_type": kind})
    else:
        config["text_config"] = text
        model_config = configs.ModelConfig.from_dict(json.loads(json.dumps(config)))
    save_random(out, family.Model(model_config), config)
    image = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": f"{name}Processor",
        "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": (2 * patch) ** 2, "max_pixels": (6 * patch) ** 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    }
    # Every file the processor reads is here: a missing one is looked up on the Hub.
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": f"{name}Processor"}))
    return out


IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
# ChatML writing image parts as Mistral's templates do: one [IMG], which the processor expands
# into the image's rows of [IMG] tokens, an [IMG_BREAK] after each row but the last, [IMG_END].
PIXTRAL_TEMPLATE = VLM_TEMPLATE.replace(BOI, IMG)


def make_tiny_mistral3(out: Path, **kw: Any) -> Path:
    """Write a random-weight Mistral 3 (Mistral Small 3.1's shape: 2x2 patches merged before
    the projector) to ``out`` (``make_tiny_pixtral_family``)."""
    return make_tiny_pixtral_family(out, "mistral3", **kw)


def make_tiny_pixtral(out: Path, **kw: Any) -> Path:
    """Write a random-weight Pixtral (Pixtral 12B's shape: a token a patch) to ``out``
    (``make_tiny_pixtral_family``)."""
    return make_tiny_pixtral_family(out, "pixtral", **kw)


def make_tiny_pixtral_family(out: Path, kind: str, *, hidden: int = 64, layers: int = 4,
                             patch: int = 8, longest_edge: int = 48, seed: int = 0) -> Path:
    """Write a random-weight checkpoint of a family with a Pixtral tower (``kind``: mistral3
    or pixtral), which reads an image at the image's own size, and a Mistral language model,
    to ``out``, made with mlx-vlm's classes. Its image processor keeps an image's aspect ratio
    within ``longest_edge`` pixels, so images of other shapes take other numbers of rows and
    columns of tokens."""
    import importlib

    import mlx.core as mx
    from transformers import AutoTokenizer

    family = importlib.import_module(f"mlx_vlm.models.{kind}")
    configs = importlib.import_module(f"mlx_vlm.models.{kind}.config")
    merge = 2 if kind == "mistral3" else 1

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, template=PIXTRAL_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": [IMG, IMG_BREAK, IMG_END]})
    tok.save_pretrained(str(out))
    config_file = out / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config["chat_template"] = PIXTRAL_TEMPLATE
    config_file.write_text(json.dumps(tok_config, indent=2))
    text = {
        "model_type": "mistral", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": hidden * 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "rms_norm_eps": 1e-6, "vocab_size": len(tok),
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "pixtral", "num_hidden_layers": 2, "hidden_size": 32, "head_dim": 16,
        "intermediate_size": 64, "num_attention_heads": 2, "image_size": longest_edge,
        "patch_size": patch, "num_channels": 3, "rope_theta": 10000.0,
    }
    name = {"mistral3": "Mistral3ForConditionalGeneration",
            "pixtral": "LlavaForConditionalGeneration"}[kind]
    config = {
        "model_type": kind, "architectures": [name],
        "text_config": text, "vision_config": vision, "spatial_merge_size": merge,
        "image_token_index": tok.convert_tokens_to_ids(IMG), "vision_feature_layer": -1,
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
        "eos_token_id": tok.eos_token_id,
    }
    mx.random.seed(seed)
    model_config = configs.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.text_config = configs.TextConfig.from_dict(text)
    model_config.vision_config = configs.VisionConfig.from_dict(vision)
    save_random(out, family.Model(model_config), config)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "size": {"longest_edge": longest_edge}, "patch_size": {"height": patch, "width": patch},
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True,
    }, indent=2))
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": patch, "spatial_merge_size": merge,
        "image_token": IMG, "image_break_token": IMG_BREAK, "image_end_token": IMG_END}))
    return out
