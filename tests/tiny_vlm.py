"""Tiny random-weight vision-language model directories, made in the test run with mlx-vlm's
own classes: a Gemma 3 (SigLIP tower, pooled projector) with a real BPE tokenizer, an image
processor config and a chat template that writes image parts, so that images go through the
same processor, tower and template code as a downloaded checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

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


def make_tiny_gemma3_vlm(out: Path, *, hidden: int = 64, layers: int = 4, image_size: int = 32,
                         patch: int = 8, image_tokens: int = 16, seed: int = 0,
                         heads: int = 4, kv_heads: int = 2, vision_hidden: int = 32,
                         vision_layers: int = 2, vision_heads: int = 2) -> Path:
    """Write a random-weight Gemma 3 vision-language checkpoint to ``out`` (the defaults:
    the tests' tiny one; benchmarks/bench_vision.py makes a larger one)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
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
    model = Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    # Wider normal weights than the default initialisation: varied greedy output, and an
    # image's features that reach the answer.
    weights = {k: (mx.random.normal(v.shape) * 2.0 / v.shape[-1] ** 0.5 if v.ndim >= 2
                   and "norm" not in k else v) for k, v in weights.items()}
    # Gemma 3 ties its output head to the embedding (mlx-lm's text model reads no head).
    weights["language_model.lm_head.weight"] = weights["language_model.model.embed_tokens.weight"]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
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
