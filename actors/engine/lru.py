"""A least-recently-used order over keys with sizes, where a key can be placed right before
another: the prefix cache keeps every block older than its ancestors. Pure Python, no MLX:
the engine's RAM blocks (``prefix_cache.py``) and the cache index's disk catalogue both use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Lru:
    """Keys with their sizes, least recently used first.

    A doubly linked list over a dict (as in ``functools.lru_cache``) rather than an
    ``OrderedDict``, which can only move a key to an end: a new block must go right before its
    parent, in O(1) however deep the chain. ``len`` and ``nbytes`` may be read from any thread.
    """

    __slots__ = ("_nodes", "_root", "nbytes")

    _PREV, _NEXT, _KEY, _SIZE = 0, 1, 2, 3

    def __init__(self) -> None:
        root: list[Any] = []
        root[:] = [root, root, None, 0]
        self._root = root
        self._nodes: dict[str, list[Any]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, h: object) -> bool:
        return h in self._nodes

    def __iter__(self) -> Iterator[str]:
        """Oldest first. Do not change the list while iterating."""
        node = self._root[self._NEXT]
        while node is not self._root:
            yield node[self._KEY]
            node = node[self._NEXT]

    def size(self, h: str) -> int:
        return self._nodes[h][self._SIZE]

    def put(self, h: str, size: int, *, before: str | None = None, oldest: bool = False) -> None:
        """Add or move ``h``: newest by default, right before ``before`` if that is here, or
        oldest."""
        node = self._nodes.get(h)
        if node is None:
            node = self._nodes[h] = [None, None, h, size]
            self.nbytes += size
        else:
            self._unlink(node)
            self.nbytes += size - node[self._SIZE]
            node[self._SIZE] = size
        if before is not None and before in self._nodes and before != h:
            anchor = self._nodes[before]
        elif oldest:
            anchor = self._root[self._NEXT]
        else:
            anchor = self._root
        prev = anchor[self._PREV]
        node[self._PREV], node[self._NEXT] = prev, anchor
        prev[self._NEXT] = anchor[self._PREV] = node

    def touch(self, h: str) -> None:
        """Make ``h`` the most recently used."""
        self.put(h, self._nodes[h][self._SIZE])

    def pop(self, h: str) -> int | None:
        """Remove ``h``; its size, or None if it was not here."""
        node = self._nodes.pop(h, None)
        if node is None:
            return None
        self._unlink(node)
        self.nbytes -= node[self._SIZE]
        return node[self._SIZE]

    def _unlink(self, node: list[Any]) -> None:
        prev, nxt = node[self._PREV], node[self._NEXT]
        prev[self._NEXT], nxt[self._PREV] = nxt, prev
