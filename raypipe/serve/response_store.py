"""`ResponseStore` deployment: the conversations `/v1/responses` may continue (`previous_response_id`).

One replica for the application, so every Ingress replica finds what another stored. Each stored
response keeps its whole conversation as chat messages (input and output; instructions are not carried
over, as OpenAI does), as JSON text. Bounded by count and by bytes (`ServeLimits.max_stored_responses`,
`max_stored_response_bytes`): the least recently used go first, and a conversation larger than the byte
bound is not kept. Memory only: a restarted store has forgotten every response (a continuation then gets
a 404 naming the id), as does a response created with `store: false`.
"""

from __future__ import annotations

from collections import OrderedDict

from ray import serve


@serve.deployment  # options (one replica) live in deployments/config.yaml
class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._conversations: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, conversation: str) -> bool:
        """Keep `conversation` (JSON) under `response_id`; False if it alone exceeds the byte bound."""
        size = len(conversation.encode())
        if size > self.max_bytes:
            return False
        self._drop(response_id)
        self._conversations[response_id] = conversation
        self._bytes += size
        while len(self._conversations) > self.max_responses or self._bytes > self.max_bytes:
            self._drop(next(iter(self._conversations)))
        return True

    def get(self, response_id: str) -> str | None:
        conversation = self._conversations.get(response_id)
        if conversation is not None:
            self._conversations.move_to_end(response_id)
        return conversation

    def stats(self) -> dict:
        return {"responses": len(self._conversations), "bytes": self._bytes}

    def _drop(self, response_id: str) -> None:
        conversation = self._conversations.pop(response_id, None)
        if conversation is not None:
            self._bytes -= len(conversation.encode())
