"""The Responses API's stored responses (`store`, `previous_response_id`, GET / DELETE by id).

In memory, bounded by count and by size: the oldest stored response goes first. Nothing
survives a restart; a `previous_response_id` that was evicted (or never stored) is a 404.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

# Far above one user's use, small beside a server's memory.
MAX_STORED_RESPONSES = 1000
MAX_STORED_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict               # the response object, as GET answers it
    conversation: list[dict]     # chat messages up to and including this answer (no instructions)
    size: int                    # characters it holds (its share of the bound)


class ResponsesStore:
    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS):
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self._chars += size
        # NOTE: the newest entry stays even when it alone is over max_chars: the client that
        # just asked for it will likely continue from it.
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries
                                          or self._chars > self.max_chars):
            _, oldest = self._entries.popitem(last=False)
            self._chars -= oldest.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.size
        return True
