"""sentence-transformers' Dense modules: a linear layer (and an activation) that some
embedding checkpoints apply after pooling, before normalisation (gte, stella and jina ones
among them), read from the model's own files (``modules.json`` names each module's folder,
``2_Dense/`` by convention, holding ``config.json`` and ``model.safetensors``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

# The activations a Dense module's config names (PyTorch's class paths, as sentence-transformers
# writes them) and what computes them here; None: the identity.
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array] | None] = {
    "torch.nn.modules.linear.Identity": None,
    "torch.nn.modules.activation.Tanh": mx.tanh,
    "torch.nn.modules.activation.ReLU": nn.relu,
    "torch.nn.modules.activation.GELU": nn.gelu,
    "torch.nn.modules.activation.Sigmoid": mx.sigmoid,
}


@dataclass(frozen=True)
class Dense:
    """One Dense module: ``activation(x @ weight.T + bias)``."""

    weight: mx.array  # (out_features, in_features)
    bias: mx.array | None
    activation: str

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        fn = ACTIVATIONS[self.activation]
        return y if fn is None else fn(y)


def dense_folders(path: str | Path) -> list[Path]:
    """The folders of the Dense modules ``modules.json`` lists, in its order."""
    path = Path(path)
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(modules, list):
        return []
    return [path / str(m.get("path", ""))
            for m in sorted((m for m in modules if isinstance(m, dict)),
                            key=lambda m: int(m.get("idx", 0)))
            if str(m.get("type", "")).endswith("models.Dense")]


def read_dense(path: str | Path) -> list[Dense]:
    """The Dense modules ``modules.json`` lists, in its order ([] without any). A module's
    weights must be ``model.safetensors``: a ``pytorch_model.bin`` (a pickle, which can run
    code when loaded) is refused by name, as is an activation not in ``ACTIVATIONS``."""
    path = Path(path)
    layers = []
    for folder in dense_folders(path):
        config = json.loads((folder / "config.json").read_text())
        activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity"))
        if activation not in ACTIVATIONS:
            raise ValueError(f"{path.name}: the Dense module in {folder.name}/ applies "
                             f"{activation}, which troupe does not compute (it does "
                             f"{', '.join(a.rsplit('.', 1)[1] for a in ACTIVATIONS)})")
        weights = folder / "model.safetensors"
        if not weights.exists():
            if (folder / "pytorch_model.bin").exists():
                raise ValueError(
                    f"{path.name}: {folder.name}/pytorch_model.bin is a PyTorch pickle, which "
                    "troupe does not load; convert it to model.safetensors (sentence-"
                    "transformers saves it so with safe_serialization=True)")
            raise ValueError(f"{path.name}: {folder.name}/ has no model.safetensors")
        tensors = mx.load(str(weights))
        weight = tensors["linear.weight"]
        shape = (config.get("out_features"), config.get("in_features"))
        if tuple(weight.shape) != shape:
            raise ValueError(f"{path.name}: {folder.name}/'s weight is {tuple(weight.shape)}, "
                             f"its config says (out_features, in_features) = {shape}")
        bias = tensors.get("linear.bias") if config.get("bias", True) else None
        layers.append(Dense(weight, bias, activation))
    return layers


def apply_dense(layers: list[Dense], pooled: mx.array) -> mx.array:
    """Pooled vectors (rows, float32) through each Dense module in turn."""
    for layer in layers:
        pooled = layer(pooled)
    return pooled
