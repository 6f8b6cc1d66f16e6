"""A tiny random-weight model directory, made in the test run: fast engine tests with real code.

The tokenizer is a real byte-level BPE trained here on a few sentences (ChatML special tokens and
chat template included), so detokenization, stop strings and templates run for real.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A template that renders tools and reasoning as the Qwen3 family's does: tools as JSON lines
# in the system turn (Hermes convention), calls in <tool_call> tags, tool results in
# <tool_response> tags inside user turns, and an assistant turn's reasoning kept only after the
# last real user message (earlier turns lose theirs), <think></think> written empty by the
# generation prompt when thinking is switched off. mlx-lm reads json_tools and <think> off it.
QWEN3_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    # The last user message that is not tool results: reasoning before it is dropped.
    "{%- set ns = namespace(last_query=messages|length - 1, looking=true) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.looking and message.role == 'user' and not (message.content.startswith("
    "'<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.looking = false %}{%- set ns.last_query = index %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content or '' %}"
    "{%- set reasoning = message.reasoning_content or '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + tool_call.name + '\\\", \\\"arguments\\\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

# The Qwen3 family's markup, each one token (added, not special: it stays in decoded text).
QWEN3_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                "</tool_response>"]

FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers like 12345 and 67890 are split into digits.",
    "Unicode: café, naïve, 東京, emoji 🙂 and more.",
    "def add(a, b):\n    return a + b\n",
] * 20


def write_tokenizer(out: Path, vocab_size: int = 512, *, template: str = CHATML,
                    added: list[str] | None = None) -> int:
    """Train a byte-level BPE with ChatML control tokens into ``out``, with ``template`` as its
    chat template and the ``added`` tokens (not special); returns its size."""
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
    if added:
        fast.add_tokens(added)
    fast.chat_template = template
    fast.save_pretrained(str(out))
    return len(fast)


def _sliding_and_full(layers: int) -> list[str]:
    """Alternate sliding-window and global attention layers, a global one last."""
    return ["sliding_attention" if (layers - 1 - i) % 2 else "full_attention"
            for i in range(layers)]


# Per architecture, what its ModelArgs needs on top of the llama settings (``hidden``, ``layers``
# given). Windows are 8 tokens, so any test prompt runs past them (gemma3's 18: some prompts
# fit in it and cross it as they decode, and chunks of 4, 16 or 24 tokens straddle its edge);
# MoE models have 4 experts, 2 a token.
ARCH_CONFIGS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "qwen2": lambda hidden, layers: {},
    # q_norm / k_norm on each head.
    "qwen3": lambda hidden, layers: {"head_dim": 16},
    # Global layers every second layer, the others sliding (RotatingKVCache); Gemma's own
    # scalings of embeddings and attention.
    "gemma3_text": lambda hidden, layers: {
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 18,
        "sliding_window_pattern": 2,
    },
    # mlx-lm runs "mistral" as llama; a window takes layer_types naming the sliding layers.
    "mistral": lambda hidden, layers: {
        "sliding_window": 8,
        "layer_types": _sliding_and_full(layers),
    },
    # Fused qkv and gate/up projections.
    "phi3": lambda hidden, layers: {},
    "qwen3_moe": lambda hidden, layers: {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": hidden,
        "norm_topk_prob": True,
    },
    # Attention sinks, sliding and global layers, biased experts.
    "gpt_oss": lambda hidden, layers: {
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": hidden,
        "sliding_window": 8,
        "layer_types": _sliding_and_full(layers),
    },
    # Gated delta-net (ArraysCache) layers and gated full attention (KVCache) layers, MoE with
    # a shared expert.
    "qwen3_next": lambda hidden, layers: {
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": hidden,
        "mlp_only_layers": [],
        "moe_intermediate_size": hidden,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 2,
    },
    # Qwen3.5: gated delta-net (ArraysCache) and gated attention (KVCache) layers, dense MLP.
    "qwen3_5": lambda hidden, layers: _qwen3_5(hidden),
    # The same with routed experts and a shared expert.
    "qwen3_5_moe": lambda hidden, layers: {
        **_qwen3_5(hidden),
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": hidden,
        "moe_intermediate_size": hidden,
        "norm_topk_prob": True,
    },
    # Gemma 4: sliding and global layers (the global ones with their own head size and
    # partial rotary), a per-layer input embedding, the last layer reading an earlier layer's
    # cache (KV sharing), logit soft-capping.
    "gemma4_text": lambda hidden, layers: {
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 1,
        "sliding_window": 8,
        "layer_types": _sliding_and_full(layers),
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": None,  # the tokenizer's size
        "num_kv_shared_layers": 1,
        "use_double_wide_mlp": True,
        # Tied, the scaled-up embedding dominates the residual stream and each step repeats
        # its input token; an untied (random) head lets the layers' context decide.
        "tie_word_embeddings": False,
    },
    # Multi-head latent attention (a KVCache of the compressed latent and the rope keys), a
    # dense first layer, then routed experts with a shared expert.
    "deepseek_v3": lambda hidden, layers: {
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    },
    # Partial rotary with q/k norms, a dense first layer, then experts with a shared one.
    "glm4_moe": lambda hidden, layers: {
        "head_dim": 16,
        "moe_intermediate_size": hidden,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.0,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    # Mamba-2 (ArraysCache), attention (KVCache), MLP and expert layers in one stack.
    "nemotron_h": lambda hidden, layers: {
        "hybrid_override_pattern": ["M", "*", "-", "E"][:layers],
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "moe_intermediate_size": hidden,
        "moe_shared_expert_intermediate_size": hidden,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    # Experts with sigmoid routing, partial rotary, q/k norms over all heads.
    "minimax": lambda hidden, layers: {
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 0,
        "rotary_dim": 8,
        "use_qk_norm": True,
    },
    # Kimi delta attention (ArraysCache) layers and MLA layers (KVCache), experts.
    "kimi_linear": lambda hidden, layers: {
        "head_dim": 16,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [i + 1 for i in range(layers) if i % 2 == 0]},
        "model_max_length": 2048,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": hidden,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        # transformers' KimiLinear config defaults name ids past the tiny vocabulary.
        "bos_token_id": 1,
        "pad_token_id": 0,
    },
}


# Embeddings scaled down (the head is tied to them): at full size, the last token's embedding
# outweighs what qwen3_5's layers add, and its 4-bit (group 64) weights answered two prompts
# that end alike the same; at a quarter every precision's answer follows the context.
EMBED_SCALE: dict[str, float] = {"qwen3_5": 0.25}


def _qwen3_5(hidden: int) -> dict[str, Any]:
    """Qwen3.5's text settings (its config may be flat: mlx-lm reads it as the text config)."""
    return {
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25},
    }


def make_tiny_model(
    out: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    dtype: str = "float32",
    template: str = "chatml",
    context: int = 2048,
    eos_head: float | None = None,
    bits: int = 0,
    group_size: int = 64,
    high_bits: int = 0,
    fim: bool = False,
) -> Path:
    """Write a random-weight mlx-lm model directory (config, weights, tokenizer) to ``out``.

    ``arch``: "llama", "lfm2" or any key of ``ARCH_CONFIGS`` (the settings that architecture's
    ``ModelArgs`` needs beyond the llama ones, at this size). ``template``: "chatml" (plain
    ChatML, no tools, no reasoning) or "qwen3" (``QWEN3_TEMPLATE`` and its tokens).
    ``context``: the model's context in tokens. ``eos_head``: with a number, the output head
    is untied and end-of-sequence gets a row of that length along a random direction, so
    that answers end by themselves (a random model otherwise writes until ``max_tokens``):
    on the tiny qwen3 at 6, fifteen prompts' greedy answers took 0 to 318 tokens, sampled at
    temperature 1, 1 to 54.

    ``bits``: with a number, the weights are quantized to it in groups of ``group_size`` by
    mlx-lm's own ``quantize_model`` (layers whose input size the group does not divide, and
    those the model's ``quant_predicate`` keeps, stay as they are), and the config says so as
    mlx-lm writes it. ``high_bits``: mixed precision as mlx-lm's recipes choose, the
    ``v_proj`` and ``down_proj`` layers (and the embedding and head) at this many bits,
    recorded per layer in the config. ``fim``: the vocabulary has Qwen2.5-Coder's
    fill-in-the-middle tokens (``FIM_TOKENS``).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    if template == "qwen3":
        vocab = write_tokenizer(out, template=QWEN3_TEMPLATE, added=QWEN3_TOKENS)
    else:
        vocab = write_tokenizer(out, added=FIM_TOKENS if fim else None)
    config: dict = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "max_position_embeddings": context,
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
    if arch in ARCH_CONFIGS:
        config.update(ARCH_CONFIGS[arch](hidden, layers))
        if "vocab_size_per_layer_input" in config:
            config["vocab_size_per_layer_input"] = vocab
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
    if arch in ARCH_CONFIGS:
        # (Only for these: llama's and lfm2's weights stay as other tests know them.) 3-D
        # weights (stacked experts, convolutions) get the same wider normal as the 2-D ones,
        # and attention sinks (zeros by default, which would leave them untested) a random
        # value per head.
        weights = {
            k: (mx.random.normal(v.shape) * 2.0 / v.shape[-1] ** 0.5 if v.ndim == 3
                else mx.random.normal(v.shape) if k.endswith("sinks") else v)
            for k, v in weights.items()
        }
    if arch in EMBED_SCALE:
        for k in [k for k in weights if k.endswith("embed_tokens.weight")]:
            weights[k] = weights[k] * EMBED_SCALE[arch]
    if eos_head is not None:
        # End-of-sequence wins where the final hidden state leans along this direction.
        direction = mx.random.normal((hidden,))
        head = mx.array(weights["model.embed_tokens.weight"])
        head[config["eos_token_id"]] = eos_head * direction / mx.linalg.norm(direction)
        weights["lm_head.weight"] = head
        config["tie_word_embeddings"] = False
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    if bits:
        weights, config = _quantize(model, weights, config, bits, group_size, high_bits)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _quantize(model: Any, weights: dict[str, Any], config: dict[str, Any], bits: int,
              group_size: int, high_bits: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The weights quantized by mlx-lm's ``quantize_model``, and the config it writes."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    model.load_weights(list(weights.items()))
    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        chosen = own(path, module) if own else True
        if (chosen is True and high_bits
                and any(k in path for k in ("v_proj", "down_proj", "embed", "lm_head"))):
            return {"group_size": group_size, "bits": high_bits, "mode": "affine"}
        return chosen

    model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    return dict(tree_flatten(model.parameters())), config
