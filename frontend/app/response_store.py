"""The Responses API's answers kept in memory (main process): what `previous_response_id`
continues and GET /v1/responses/{id} returns, while the process lives.

Bounded by --max-stored-responses, the oldest dropped first. A stored response keeps its
text, calls and usage but not its logprobs (top-k arrays would make an entry hundreds of
times larger); a retrieved response shows `logprobs: []`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenmill.frontend.api.common import ApiError
from tokenmill.frontend.api.openai_requests import ChatMessage


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[ChatMessage]  # its input and its answer, as chat messages


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[ChatMessage]) -> None:
        if self.capacity <= 0:
            return
        self._entries[response["id"]] = StoredResponse(_without_logprobs(response), conversation)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise ApiError(
                f"Response with id {response_id!r} not found (responses are kept in memory, "
                f"the latest {self.capacity}, and only with store: true)",
                param,
                status=400 if param else 404,
                code="previous_response_not_found" if param else "not_found",
            )
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]


def _without_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    output = []
    for item in response["output"]:
        if item["type"] == "message":
            parts = [{**part, "logprobs": []} for part in item["content"]]
            item = {**item, "content": parts}
        output.append(item)
    return {**response, "output": output}
