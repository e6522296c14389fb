"""``pip install .`` gives working commands outside the checkout: the package installed (as a
wheel, not editable) into a fresh virtual environment, whose third-party packages come from the
project's environment; ``torchrec-serve`` then builds an archive from a shipped spec in another
folder, with the shipped config and the installed ``handlers``."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fresh")
    venv.create(root / "venv")  # no pip of its own: the project's installs into it (--python)
    python = root / "venv" / "bin" / "python"
    site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    # The dependencies (torch, TorchRec, TorchServe, ...) as the project's environment has them.
    (root / site / "project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    source = root / "source"  # a copy: building a wheel writes build/ into the source folder
    shutil.copytree(
        REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "model_store", "results", "build")
    )
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(source)],
        check=True, capture_output=True, timeout=600,
    )
    wheel = next(wheels.glob("torchrec_serve-*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True, timeout=600,
    )
    return root / "venv" / "bin"


def test_the_installed_commands_work_outside_the_checkout(fresh_env, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = str(fresh_env / "torchrec-serve")
    help_text = subprocess.run([command, "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert help_text.returncode == 0 and "build" in help_text.stdout and "serve" in help_text.stdout
    where = subprocess.run(
        [str(fresh_env / "python"), "-c", "import handlers, archive_tools.resources as r; "
         "print(handlers.__file__); print(r.config_dir())"],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=True,
    ).stdout.split()
    assert all(not path.startswith(str(REPO)) for path in where), where
    built = subprocess.run(
        [command, "build", "--spec", "tiny", "--model-store", "store"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "store" / "tiny.mar") as archive:
        names = set(archive.namelist())
    assert {"spec.yaml", "inputs.json", "weights.pt", "handlers/loading.py"} <= names
    bad = subprocess.run([command, "build", "--spec", "nonesuch"], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert bad.returncode == 7 and "nonesuch: no such spec file" in bad.stderr
