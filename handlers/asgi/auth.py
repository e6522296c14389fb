"""Keys of the ASGI engine: every request carries ``Authorization: Bearer KEY``; a missing or wrong
key is refused (400 ``InvalidKeyException``, TorchServe's answer) on every route but the health
probes and the metrics (``OPEN_PATHS``: a kubelet's probes carry no key, nor does a scrape of
TorchServe's metrics port). The management routes (``MANAGEMENT_PREFIXES``: ``/models``,
``/freshness``) take the management key alone, every other route the inference key alone.

The key file is JSON, ``{"inference": {"key": "..."}, "management": {"key": "..."}}``: the parts of
TorchServe's ``key_file.json`` that its clients read (``json.load(f)["inference"]["key"]``). Unlike
TorchServe's, the keys do not expire and there is no API key: a file that exists is read, so an
operator gives every replica the same keys (a Kubernetes Secret); one that does not is written with
fresh keys, readable by its owner only. A file without ``management`` leaves the management
routes refused.

    keys = KeyFile(Path("keys.json"))               # made now if the file does not exist
    app = KeyCheck(app, keys.key(), keys.management_key())   # ASGI middleware
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
MANAGEMENT_PREFIXES = ("/models", "/freshness")

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
                json.dump({"inference": {"key": fresh}, "management": {"key": secrets.token_urlsafe(24)}}, out)
        try:
            key = json.loads(self.path.read_text())["inference"]["key"]
        except (ValueError, KeyError, TypeError):
            raise InputError(f"{self.path}: must be JSON {{\"inference\": {{\"key\": \"...\"}}}}") from None
        if not isinstance(key, str) or not key:
            raise InputError(f"{self.path}: inference.key: must be a non-empty string")
        return key

    def management_key(self) -> str | None:
        """The file's management key; None where it names none (management is then refused)."""
        section = json.loads(self.path.read_text()).get("management")
        if section is None:
            return None
        key = section.get("key") if isinstance(section, dict) else None
        if not isinstance(key, str) or not key:
            raise InputError(f"{self.path}: management.key: must be a non-empty string")
        return key


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
