"""Keys of the ASGI engine: every request carries ``Authorization: Bearer KEY``; a missing or wrong
key is refused (400 ``InvalidKeyException``, TorchServe's answer) on every route but the health
probes and the metrics (``OPEN_PATHS``: a kubelet's probes carry no key, nor does a scrape of
TorchServe's metrics port).

The key file is JSON, ``{"inference": {"key": "..."}}``: the part of TorchServe's
``key_file.json`` that an inference client reads (``json.load(f)["inference"]["key"]``). Unlike
TorchServe's, the key does not expire and there is no management or API key (this engine has no
management API): a file that exists is read, so an operator gives every replica the same key (a
Kubernetes Secret); one that does not is written with a fresh key, readable by its owner only.

    key = KeyFile(Path("keys.json")).key()          # made now if the file does not exist
    app = KeyCheck(app, key)                        # ASGI middleware
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any, Awaitable, Callable

from handlers.asgi.answers import refusal
from handlers.runtime.errors import InputError, InvalidKeyException

OPEN_PATHS = frozenset({"/ping", "/v2/health/live", "/v2/health/ready", "/metrics"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class KeyFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def key(self) -> str:
        """The file's inference key; a missing file is written with a fresh one first."""
        if not self.path.exists():
            fresh = secrets.token_urlsafe(24)
            descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                json.dump({"inference": {"key": fresh}}, out)
        try:
            key = json.loads(self.path.read_text())["inference"]["key"]
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{self.path}: must be JSON {{\"inference\": {{\"key\": \"...\"}}}}") from None
        if not isinstance(key, str) or not key:
            raise InputError(f"{self.path}: inference.key: must be a non-empty string")
        return key


class KeyCheck:
    """ASGI middleware: HTTP requests outside ``OPEN_PATHS`` need the key."""

    def __init__(self, app: Callable, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._carries_key(scope):
            await self.app(scope, receive, send)
            return
        response = refusal(InvalidKeyException(), v2=False)
        await response(scope, receive, send)

    def _carries_key(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False
