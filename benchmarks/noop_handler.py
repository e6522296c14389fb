"""A handler that does no work: it answers every request of a TorchServe batch with the same small
score body. Served through the same TorchServe configuration as the model, it measures the
server's own floor (HTTP, batching, the frontend-to-worker round trip), against which every handler
figure in the speed benchmark is read."""

from __future__ import annotations

from typing import Any

ANSWER = b'{"scores":[0.5]}'


class NoopHandler:
    def initialize(self, context: Any) -> None:
        self.initialized = True

    def handle(self, data: list[Any], context: Any) -> list[bytes]:
        return [ANSWER] * len(data)
