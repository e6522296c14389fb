"""How the benchmarks build archives: a build whose output was kept back says, when it fails,
what it printed."""

from pathlib import Path

import pytest

from benchmarks.building import build


def test_a_quiet_build_that_fails_raises_with_its_output(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)building nonesuch failed with exit status 7:.*nonesuch: no such spec file"):
        build(Path("nonesuch"), tmp_path / "store", quiet=True)
