"""A random-weight model of another architecture at the default model's size, for the harness.

The default model's shape (SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV heads) and its
tokenizer and chat template, with the architecture named by ``--arch`` (mlx-lm's own model
class) and random weights: the same work per token as the default model, so a harness run on
it shows what that architecture's path through the engine costs. Its text is gibberish; the
servers compared still get identical prompts and produce the same tokens greedily.

    .venv/bin/python benchmarks/random_model.py --arch qwen3 --out bench-results/qwen3-135m
    .venv/bin/python benchmarks/harness.py --model bench-results/qwen3-135m
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# What each architecture's ModelArgs needs beyond the llama settings of the default model.
EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},  # head_dim 64 is the default model's; qwen3 adds q/k norms per head
    "gemma3_text": {"query_pre_attn_scalar": 64, "sliding_window": 512,
                    "sliding_window_pattern": 6},
    # Qwen3.5's hybrid: three gated-delta-net layers to one of attention, its heads of 128.
    "qwen3_5": {"linear_num_key_heads": 4, "linear_num_value_heads": 8,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                "rope_parameters": {"type": "default", "rope_theta": 100000.0,
                                    "partial_rotary_factor": 0.25}},
}


def make(out: Path, arch: str, base: Path, seed: int = 0) -> Path:
    """Write ``base``'s config (with ``arch``) and tokenizer, and random weights, to ``out``."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    config = json.loads((base / "config.json").read_text())
    config.pop("architectures", None)
    config.update(model_type=arch, **EXTRA[arch])
    arch_module = importlib.import_module(f"mlx_lm.models.{arch}")  # how mlx-lm's load finds it
    mx.random.seed(seed)
    model = arch_module.Model(arch_module.ModelArgs.from_dict(config))
    # Matrices as a trained model's are scaled (std 1/sqrt(fan-in)): activations stay in
    # range through 30 layers; norms keep their ones.
    weights = {k: (mx.random.normal(v.shape) / v.shape[-1] ** 0.5 if v.ndim >= 2 else v)
               for k, v in tree_flatten(model.parameters())}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3", choices=sorted(EXTRA))
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--base", help="the model whose shape and tokenizer to take "
                   "(default: troupe pull's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    base = args.base or subprocess.run(
        [sys.executable, "-m", "troupe.api.cli", "pull"], check=True, cwd=REPO, capture_output=True,
        text=True).stdout.strip().splitlines()[-1]
    print(make(Path(args.out), args.arch, Path(base), args.seed))


if __name__ == "__main__":
    main()
