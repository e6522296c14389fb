"""Library noise we understand, silenced where it is made, for the block that makes it.

Each use names its loggers and says in a comment what it silences and why it is harmless; real
warnings keep reaching the log. Levels are restored on exit.

    with quieter(""):                 # FBGEMM logs every library it loads on the root logger
        import fbgemm_gpu
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator


@contextlib.contextmanager
def quieter(
    *loggers: str, level: int = logging.ERROR, warning_messages: tuple[str, ...] = ()
) -> Iterator[None]:
    """Within the block, ``loggers`` ("" is the root logger) log only at ``level`` or above, and
    Python warnings matching ``warning_messages`` (regular expressions) are not shown."""
    saved = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(level)
    try:
        with warnings.catch_warnings():
            for message in warning_messages:
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        for name, before in saved.items():
            logging.getLogger(name).setLevel(before)
