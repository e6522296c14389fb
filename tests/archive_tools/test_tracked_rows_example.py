"""The ModelDeltaTracker example: TorchRec's tracker, on CPU, names exactly the rows training
changed, and a delta of them turns the archive into a fresh build of the trained weights."""

import subprocess
import sys

from tests.conftest import REPO


def test_the_tracked_rows_are_the_changed_rows_and_their_delta_verifies(tmp_path):
    done = subprocess.run(
        [sys.executable, "examples/track_touched_rows.py", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tracked = [line for line in done.stdout.splitlines() if "rows tracked" in line]
    assert len(tracked) == 4 and all(line.endswith("the same rows") for line in tracked), done.stdout
    assert "equals a fresh build of the trained weights" in done.stdout, done.stdout
