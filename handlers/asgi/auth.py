"""Keys of the ASGI engine: every request carries ``Authorization: Bearer KEY``; a missing or wrong
key is refused (400 ``InvalidKeyException``, TorchServe's answer) on every route but the health
probes and the metrics (``OPEN_PATHS``: a kubelet's probes carry no key, nor does a scrape of
TorchServe's metrics port). The management routes (``MANAGEMENT_PREFIXES``: ``/models``,
``/freshness``) take the management key alone, every other route the inference key alone. The
keys come from the key file (``key_file.py``):

    keys = KeyFile(Path("keys.json"))               # made now if the file does not exist
    app = KeyCheck(app, keys.key(), keys.management_key())   # ASGI middleware
"""

from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

from handlers.asgi.answers import refusal
from handlers.runtime.errors import InvalidKeyException

OPEN_PATHS = frozenset({"/ping", "/v2/health/live", "/v2/health/ready", "/metrics"})
MANAGEMENT_PREFIXES = ("/models", "/freshness")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class KeyCheck:
    """ASGI middleware: HTTP requests outside ``OPEN_PATHS`` need the key of their route's kind."""

    def __init__(self, app: Callable, key: str, management_key: str | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.expected_management = f"Bearer {management_key}".encode() if management_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._carries_key(scope):
            await self.app(scope, receive, send)
            return
        response = refusal(InvalidKeyException(), v2=False)
        await response(scope, receive, send)

    def _carries_key(self, scope: Scope) -> bool:
        path: str = scope["path"]
        management = any(path == p or path.startswith(p + "/") for p in MANAGEMENT_PREFIXES)
        expected = self.expected_management if management else self.expected
        if expected is None:
            return False
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, expected)
        return False
