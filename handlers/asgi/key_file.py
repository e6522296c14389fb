"""The ASGI engine's key file: JSON, ``{"inference": {"key": "..."}, "management": {"key":
"..."}}``, the parts of TorchServe's ``key_file.json`` that its clients read
(``json.load(f)["inference"]["key"]``). Unlike TorchServe's, the keys do not expire and there is
no API key: a file that exists is read, so an operator gives every replica the same keys (a
Kubernetes Secret); one that does not is written with fresh keys, readable by its owner only. A
file without ``management`` leaves the management routes refused.

    keys = KeyFile(Path("keys.json"))               # made now if the file does not exist
    keys.key(), keys.management_key()
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from handlers.runtime.errors import InputError


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
