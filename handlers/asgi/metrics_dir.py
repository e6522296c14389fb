"""Where the ASGI engine's processes count (prometheus_client's multiprocess mode): a directory
the launching process chooses for itself and the server processes it starts, before any counter
exists (``metrics.py`` counts and scrapes).

    use_directory(Path(tempfile.mkdtemp()))          # in the launching process
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import values

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def use_directory(path: Path) -> None:
    """Counts of this process and the ones it starts go to ``path``. prometheus_client picks its
    value store from the environment when first imported, which the CLI has done already (its
    scrape parser), so the choice is made again here, before any counter exists."""
    os.environ[MULTIPROC_ENV] = str(path)
    values.ValueClass = values.get_value_class()
