"""The prefix cache's RAM tier keeps its byte count as blocks come and go, so that a report
read from another thread never iterates the blocks while the MLX thread changes them."""

from __future__ import annotations

import mlx.core as mx

from actors.engine.kv_blocks import KVBlock, RamTier


def _block(h: str, n: int, parent: str | None = None) -> KVBlock:
    kv = (mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
    return KVBlock(block_hash=h, parent_hash=parent, n_tokens=n, layers=[kv])


def test_ram_tier_byte_count_follows_sets_replacements_and_pops():
    tier = RamTier()
    assert tier.nbytes == 0
    tier["a"] = _block("a", 4)
    tier["b"] = _block("b", 8, parent="a")
    assert tier.nbytes == sum(b.nbytes for b in tier.values()) == 2 * 2 * 4 * 4 * 4 * 3
    tier["a"] = _block("a", 2)  # replaced: counted once, at its new size
    assert tier.nbytes == sum(b.nbytes for b in tier.values())
    tier.pop("b")
    tier.pop("missing")
    assert tier.nbytes == tier["a"].nbytes
    tier.pop("a")
    assert tier.nbytes == 0 and len(tier) == 0
