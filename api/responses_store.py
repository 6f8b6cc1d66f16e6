"""The Responses API's stored responses: what ``previous_response_id`` and
``GET /v1/responses/{id}`` read, in memory, the least recently used dropped first.

Each entry holds the response as it was answered and the conversation up to its end: every
input item of the chain that led to it (its own request's included) followed by its output
items. The items are shared between the entries of one chain, not copied: an entry costs a
list of references. A request's ``instructions`` are not kept in the chain (OpenAI's rule:
they are not carried over to the next response).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the ``response`` object as answered, and ``items``, the
    conversation that a request naming it as ``previous_response_id`` continues."""

    response: Any  # api.responses.ResponseObject
    items: tuple[Any, ...]  # api.responses.InputItem


class ResponseStore:
    """At most ``size`` responses by id (0: none are kept), the least recently used (stored,
    read or continued) evicted first. Used from the event loop's thread only."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        """Whether responses are kept at all."""
        return self.size > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep a response, evicting the least recently used past ``size``."""
        if not self.enabled:
            return
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the most recently used; None when it is not kept."""
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was kept."""
        return self._entries.pop(response_id, None) is not None
