"""The package's layering (pyproject.toml, [tool.importlinter]): the serve-time runtime imports no
build-time module, TorchRec or TorchAO; handlers never import the archive tool or the benchmarks."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 kept, 0 broken" in done.stdout
