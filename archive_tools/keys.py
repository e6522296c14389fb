"""TorchServe's token keys, kept valid for a client on the server's host.

TorchServe writes ``key_file.json`` into its launch directory: an inference key, a management key
(each with an expiration time, ``token_expiration_min`` after it was made) and an API key that
does not expire. Past its expiration a key is refused with a 400 ``InvalidKeyException``. The
supported way to a fresh key is ``GET /token?type=inference`` (or ``management``) on the
management port with the API key: TorchServe makes a new key, invalidates the old one and
rewrites the file.

    keys = TokenKeys(Path("key_file.json"), "http://127.0.0.1:8081")
    requests.post(url, headers=keys.header("inference"), ...)   # refreshed shortly before expiry
    if keys.rejected(response):                                   # another client refreshed first
        keys.recover("inference", used=...)                       # then retry once

Several clients may share one key file: a refresh by one invalidates the key the others hold, so
a refused request re-reads the file before it refreshes again.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from pathlib import Path

import requests

APIS = ("inference", "management")
REJECTION = "InvalidKeyException"


class TokenKeys:
    """The keys in ``key_file`` (absent file: token authorization is off, no header is sent)."""

    def __init__(self, key_file: Path, management_url: str, timeout_s: float = 10.0) -> None:
        self.key_file = Path(key_file)
        self.management_url = management_url.rstrip("/")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._keys: dict[str, tuple[str, float, float]] = {}  # api -> (key, read at, expires at)
        self._api_key: str | None = None
        self.refreshes = 0
        self._read()

    @property
    def enabled(self) -> bool:
        return self._api_key is not None

    def key(self, api: str) -> str | None:
        """The current ``api`` key, refreshed first when it expires within a quarter of its
        lifetime (at most a minute)."""
        if not self.enabled:
            return None
        with self._lock:
            key, read_at, expires_at = self._keys[api]
            margin = min(60.0, (expires_at - read_at) / 4)
            if time.time() > expires_at - margin:
                self._refresh(api, key)
            return self._keys[api][0]

    def header(self, api: str) -> dict[str, str]:
        key = self.key(api)
        return {"Authorization": f"Bearer {key}"} if key else {}

    @staticmethod
    def rejected(response: requests.Response) -> bool:
        """Whether TorchServe refused the request's key (expired, refreshed by another client)."""
        return response.status_code == 400 and REJECTION in response.text

    def recover(self, api: str, used: str | None) -> None:
        """After a refusal of key ``used``: take the file's newer key if another client
        refreshed, else refresh it here."""
        with self._lock:
            self._read()
            if self._keys.get(api, (None,))[0] == used:
                self._refresh(api, used)

    def _refresh(self, api: str, stale: str | None) -> None:
        """A new ``api`` key from TorchServe's token API (callers hold the lock)."""
        self._read()
        if self._keys[api][0] != stale:
            return  # another client refreshed it already
        response = requests.get(
            f"{self.management_url}/token",
            params={"type": api},
            headers={"Authorization": f"Bearer {self._api_key}"},
            timeout=self.timeout_s,
        )
        if response.status_code != 200:
            raise RuntimeError(f"refreshing the {api} key failed: {response.status_code} {response.text[:200]}")
        self.refreshes += 1
        self._read()

    def _read(self) -> None:
        if not self.key_file.exists():
            return
        for attempt in range(50):  # TorchServe may be rewriting it this moment
            try:
                content = json.loads(self.key_file.read_text())
                break
            except json.JSONDecodeError:
                if attempt == 49:
                    raise
                time.sleep(0.01)
        now = time.time()
        self._api_key = content["API"]["key"]
        for api in APIS:
            key = content[api]["key"]
            if self._keys.get(api, (None,))[0] != key:
                expires = dt.datetime.fromisoformat(content[api]["expiration time"]).timestamp()
                self._keys[api] = (key, now, expires)
