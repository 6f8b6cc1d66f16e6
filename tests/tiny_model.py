"""A tiny random-weight model directory, made in the test run: fast engine tests with real code.

The tokenizer is a real byte-level BPE trained here on a few sentences (ChatML special tokens and
chat template included), so detokenization, stop strings and templates run for real.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers like 12345 and 67890 are split into digits.",
    "Unicode: café, naïve, 東京, emoji 🙂 and more.",
    "def add(a, b):\n    return a + b\n",
] * 20


def write_tokenizer(out: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE with ChatML control tokens into ``out``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    return len(fast)


def make_tiny_model(
    out: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight mlx-lm model directory (config, weights, tokenizer) to ``out``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out)
    config: dict = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    if arch == "lfm2":
        config.update(
            {
                "block_dim": hidden,
                "block_ff_dim": hidden * 2,
                "block_multiple_of": 16,
                "block_ffn_dim_multiplier": 1.0,
                "block_auto_adjust_ff_dim": False,
                "conv_bias": False,
                "conv_L_cache": 3,
                "full_attn_idxs": [i for i in range(layers) if i % 2 == 1],
                "norm_eps": 1e-5,
            }
        )
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    # Default initialisation makes a tiny model repeat one token forever, which would hide
    # batching bugs; wider normal weights give varied, still deterministic, greedy output.
    weights = {
        k: (mx.random.normal(v.shape) * 2.0 / v.shape[-1] ** 0.5 if v.ndim == 2 else v)
        for k, v in weights.items()
    }
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
