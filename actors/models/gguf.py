"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

MLX reads GGUF natively (``mx.load``): Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine-quantized
triples (``weight``/``scales``/``biases``, group size 32) in ``[out, in]`` order, other types
arrive dense. This module renames the tensors to mlx-lm's llama layout, undoes llama.cpp's
q/k row permutation, writes ``config.json`` and rebuilds a Hugging Face tokenizer from the
GGUF vocabulary so that plain ``mlx_lm.load(out_dir)`` works.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

# Bump when the output format changes so cached conversions are not reused.
CONVERTER_VERSION = 1

# Output dtypes. "quantized*" keep the GGUF's packed Q4_0/Q4_1/Q8_0 weights (values exact to
# the file) with scales, biases, norms and hence activations in float32 or float16; the others
# dequantize every matrix to that float type.
QUANTIZED = "quantized"
QUANTIZED_F16 = "quantized-float16"
_FLOAT_DTYPES: dict[str, mx.Dtype] = {
    QUANTIZED: mx.float32,
    QUANTIZED_F16: mx.float16,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}
DTYPES = tuple(_FLOAT_DTYPES)
# Chosen by measurement (docs/models.md, benchmarks/bench_dtype.py): float32 is exact enough
# (same greedy output as the packed weights) and, with OpenBLAS, several times faster on CPU.
DEFAULT_DTYPE = "float32"
# ...but dequantizing multiplies the size by ~6 (4-5 bits -> 32); above this GGUF size the
# default keeps the weights packed instead (a 7B Q4 file would become ~28 GB).
DENSE_DEFAULT_MAX_GGUF_BYTES = 512 << 20

# GGUF quantized blocks hold 32 values (Q4_0, Q4_1, Q8_0: the types MLX keeps packed).
GGUF_GROUP_SIZE = 32

# llama.cpp token types (llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GGUF tensor name -> mlx-lm name; per-layer names are under blk.N / model.layers.N.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors llama.cpp may carry that mlx-lm recomputes itself.
_IGNORED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}

# GPT-2's split pattern; llama.cpp's "smollm" pre-tokenizer additionally isolates every digit.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (unsupported architecture, tokenizer or tensor)."""


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """Read a scalar metadata value (mx.array scalars become Python numbers)."""
    if key not in meta:
        if default is None:
            raise GGUFConversionError(f"GGUF metadata lacks {key!r}")
        return default
    value = meta[key]
    if isinstance(value, mx.array):
        return value.item()
    return value


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's rope permutation of a q/k projection's output rows.

    llama.cpp exports HF rows ordered (head, half, pair) as (head, pair, half) so that
    its interleaved rope works; mlx-lm's llama uses HF's rotate-half layout. Scales and
    biases of quantized weights are permuted identically (their groups run along axis 1).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFConversionError(f"{rows} rows cannot be split into {n_head} rope heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _model_config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """Build mlx-lm's llama config.json from the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"only llama-architecture GGUF files are supported, not {arch!r}")

    def key(name: str, default: Any = None) -> Any:
        return _scalar(meta, f"llama.{name}", default)

    hidden = int(key("embedding_length"))
    n_head = int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_head))
    head_dim = int(key("attention.key_length", hidden // n_head))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFConversionError("partial rotary embeddings are not supported for llama")
    if "rope_freqs.weight" in weights:
        # Llama 3.1-style frequency factors need a rope_scaling block GGUF does not keep.
        raise GGUFConversionError("GGUF files with rope_freqs (Llama 3.1+) are not supported")
    n_vocab = len(meta["tokenizer.ggml.tokens"])

    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "vocab_size": int(key("vocab_size", n_vocab)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id", -1)),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id", -1)),
    }
    for tok_key in ("bos_token_id", "eos_token_id"):
        if config[tok_key] < 0:
            del config[tok_key]
    scaling = meta.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFConversionError(f"rope scaling {scaling!r} is not supported")
    return config


def _rename(name: str) -> str | None:
    """Map a GGUF tensor name (``blk.3.attn_q.scales``) to mlx-lm's (None: drop it)."""
    base, _, suffix = name.rpartition(".")
    if base in _IGNORED:
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise GGUFConversionError(f"unexpected tensor {name!r} for a llama model")


def _quant_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per value of a packed tensor: uint32 words per row vs values per row."""
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    bits, rem = divmod(weight.shape[-1] * 32, in_features)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise GGUFConversionError(f"cannot infer quantization bits from {weight.shape}")
    return bits


def _convert_weights(
    weights: dict[str, mx.array], config: dict[str, Any], dtype: str
) -> tuple[dict[str, mx.array], dict[str, int] | None]:
    """Rename, un-permute and cast the tensors; return them and the quantization block."""
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        new = _rename(name)
        if new is not None:
            out[new] = w

    n_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name in list(out):
        proj = name.rsplit(".", 2)[-2]
        if proj in n_heads:
            out[name] = _unpermute_rows(out[name], n_heads[proj])

    bits_seen: Counter[int] = Counter()
    for name in [n for n in out if n.endswith(".scales")]:
        prefix = name[: -len(".scales")]
        w, scales, biases = out[f"{prefix}.weight"], out[name], out[f"{prefix}.biases"]
        bits = _quant_bits(w, scales)
        if dtype in (QUANTIZED, QUANTIZED_F16):
            bits_seen[bits] += 1
            continue
        dense = mx.dequantize(w, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits)
        out[f"{prefix}.weight"] = dense
        del out[name], out[f"{prefix}.biases"]

    # One float dtype for everything else, so activations (which follow the embedding's
    # dtype) never mix types: MLX's CPU kernels are far slower in float16 than in float32.
    float_dtype = _FLOAT_DTYPES[dtype]
    for name, w in out.items():
        if mx.issubdtype(w.dtype, mx.floating) and w.dtype != float_dtype:
            out[name] = w.astype(float_dtype)

    _check_shapes(out, config)
    quantization = None
    if bits_seen:
        # mlx-lm infers each layer's bits from its scales; this is the default for the rest.
        quantization = {"group_size": GGUF_GROUP_SIZE, "bits": bits_seen.most_common(1)[0][0]}
    return out, quantization


def _check_shapes(weights: dict[str, mx.array], config: dict[str, Any]) -> None:
    """Fail early if a matrix is not [out, in] as mlx-lm's llama expects."""
    hidden, ff = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    expected = {
        "self_attn.q_proj": (q_dim, hidden),
        "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden),
        "self_attn.o_proj": (hidden, q_dim),
        "mlp.gate_proj": (ff, hidden),
        "mlp.up_proj": (ff, hidden),
        "mlp.down_proj": (hidden, ff),
    }
    for layer, shape in expected.items():
        prefix = f"model.layers.0.{layer}"
        w = weights[f"{prefix}.weight"]
        scales = weights.get(f"{prefix}.scales")
        cols = scales.shape[1] * GGUF_GROUP_SIZE if scales is not None else w.shape[1]
        if (w.shape[0], cols) != shape:
            raise GGUFConversionError(f"{prefix} is {(w.shape[0], cols)}, expected {shape}")


def _pre_tokenizer(pre: str) -> Any:
    """The Hugging Face pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` name."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in ("default", "gpt2", "gpt-2"):
        log.warning("unknown GGUF pre-tokenizer %r; using GPT-2's byte-level split", pre)
    return byte_level


def _token_content(meta: dict[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    return meta["tokenizer.ggml.tokens"][int(token_id.item())]


def _write_tokenizer(meta: dict[str, Any], out_dir: Path, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConversionError(
            f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, not {model!r}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise GGUFConversionError("malformed tokenizer.ggml.merges entry")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    types = meta["tokenizer.ggml.token_type"].tolist()
    added = [
        AddedToken(tokens[i], special=t == _TOKEN_CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    special = {
        name: content
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if (content := _token_content(meta, key)) is not None
    }
    added_decoder = {
        str(vocab[tok.content]): {
            "content": tok.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok.special,
        }
        for tok in added
    }

    def flag(key: str) -> bool:
        value = meta.get(f"tokenizer.ggml.{key}")
        return bool(value.item()) if value is not None else False

    tokenizer_config: dict[str, Any] = {
        # The generic class loads tokenizer.json verbatim (named classes may rebuild it).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": flag("add_bos_token"),
        "add_eos_token": flag("add_eos_token"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": [t.content for t in added if t.special],
        **special,
    }
    if template := meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = template
    special_map = {
        **special,
        "additional_special_tokens": tokenizer_config["additional_special_tokens"],
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_map)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def default_dtype(gguf_path: Path) -> str:
    """The dtype ``convert_gguf`` uses when none is given: DEFAULT_DTYPE for files up to
    DENSE_DEFAULT_MAX_GGUF_BYTES, QUANTIZED for bigger ones."""
    if Path(gguf_path).stat().st_size > DENSE_DEFAULT_MAX_GGUF_BYTES:
        return QUANTIZED
    return DEFAULT_DTYPE


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str | None = None) -> None:
    """Convert a llama GGUF file into an mlx-lm model directory at ``out_dir``.

    ``dtype`` is one of DTYPES: ``"quantized"``/``"quantized-float16"`` keep Q4_0/Q4_1/Q8_0
    weights packed, ``"float16"``, ``"bfloat16"`` or ``"float32"`` dequantize them;
    None means ``default_dtype(gguf_path)``.
    Writes config.json, model.safetensors and the tokenizer files; ``out_dir`` is created.
    """
    dtype = dtype or default_dtype(gguf_path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    try:
        weights, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as exc:  # mx.load raises bare RuntimeError/ValueError on bad files
        raise GGUFConversionError(f"cannot read GGUF file {gguf_path}: {exc}") from exc

    config = _model_config(meta, weights)
    new_weights, quantization = _convert_weights(weights, config, dtype)
    if quantization is not None:
        config["quantization"] = quantization
        # mlx-lm also reads this key (e.g. when re-saving); keep both like its own converter.
        config["quantization_config"] = quantization

    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(meta, out_dir, config["max_position_embeddings"])
    mx.save_safetensors(str(out_dir / "model.safetensors"), new_weights, metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
