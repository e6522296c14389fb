"""The build's stage bar: tqdm's bar on a terminal; written to a log (no terminal), one line per
stage instead, since a bar's redraws there have no line ends and run into every printed line.

    with StageBar(6, "archive") as stages:
        stages.set_postfix_str("verify")   # terminal: the bar's label; log: "archive: verify"
        stages.update()
"""

from __future__ import annotations

import sys

from tqdm import tqdm


class StageBar(tqdm):
    def __init__(self, total: int, desc: str) -> None:
        self.name = desc
        super().__init__(total=total, desc=desc, unit="stage", file=sys.stderr, disable=None)  # None: off without a tty

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        if self.disable:
            print(f"{self.name}: {s}", file=sys.stderr, flush=True)
        else:
            super().set_postfix_str(s, refresh)
