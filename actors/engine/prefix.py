"""Naming of prefix-cache blocks: chain hashes over token ids, and the model fingerprint.

Pure Python (no MLX): admission, the scheduler and tests all name blocks the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path


def model_fingerprint(model_dir: Path) -> str:
    """A short id of the model's weights and config: blocks of another model never match.

    Hashes config.json and the names and sizes of the weight files (reading gigabytes of
    weights at every start would cost more than it protects against).
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def namespace_root(fingerprint: str, namespace: str = "") -> str:
    """Where a prompt's chain of block names starts: the model fingerprint, mixed with the
    request's cache namespace when it has one (an API key's, a ``cache_salt``'s). Prompts of
    two namespaces share no block name, so neither can hit the other's blocks; the shared
    namespace ("") keeps the fingerprint itself, the names blocks had before namespaces."""
    if not namespace:
        return fingerprint
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{fingerprint}|namespace|{namespace}".encode())
    return h.hexdigest()


def chain_hash(parent: str, tokens: Sequence[int]) -> str:
    """The name of ``tokens`` following what ``parent`` names (a block's hash, or the chain's
    root at the start of a prompt: ``namespace_root``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.encode())
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    return h.hexdigest()


def block_hashes(root: str, tokens: list[int], block_size: int) -> list[str]:
    """Chain hashes of the full blocks of ``tokens`` from ``root`` (the model fingerprint, or
    a namespace's root: ``namespace_root``): block i's name covers every token before it, so
    equal names mean equal prefixes."""
    hashes: list[str] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def usable_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading blocks of a prompt may come from cache: at least one prompt token must
    still run through the model to produce the first output's logits."""
    return max(0, (prompt_len - 1) // block_size)
