"""examples/kserve/Dockerfile against the Makefile it mirrors, read as text: no docker here.

Checked: the image's pip installs are `make setup`'s pinned steps, in its order and with its
--no-deps (torch first, the project, torchrec), on the Python pyproject.toml requires, with the JDK
the Makefile's `java` target installs; it runs `torchrec-serve serve --engine asgi` and exposes
KServe's ports; the ServingRuntime's args are `serve` options. Not checked: that it builds.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from archive_tools import cli_args

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "examples" / "kserve" / "Dockerfile"

# The Makefile installs these too, and the image does not need them.
NOT_IN_IMAGE = {
    "examples/din": "the DIN example: a user's own architecture package",
    "kserve": "the KServe SDK's models, which tests/examples/kserve_schemas.py checks manifests with",
}


def _pip_steps(commands: list[str]) -> list[tuple[str, bool]]:
    """Each `pip install` of ``commands`` as (what, --no-deps); the project is '.', extras dropped.

    >>> _pip_steps(["$(BIN)/pip install --quiet --no-deps torchrec==1.8.0"])
    [('torchrec==1.8.0', True)]
    """
    steps = []
    for command in commands:
        words = shlex.split(command, comments=True)
        if len(words) < 2 or not words[0].endswith("pip") or words[1] != "install":
            continue
        targets = [word for word in words[2:] if not word.startswith("-")]
        steps += [(re.sub(r"^\.\[.*\]$", ".", target), "--no-deps" in words) for target in targets]
    return [step for step in steps if step[0] != "pip"]  # pip's own upgrade


def _makefile_recipe(target: str) -> list[str]:
    """The commands of a Makefile rule (its tab-indented lines)."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _instructions(name: str) -> list[str]:
    return [arguments for instruction, arguments in _dockerfile() if instruction == name]


def _run_commands() -> list[str]:
    return [command.strip() for run in _instructions("RUN") for command in run.split("&&")]


def test_the_image_installs_the_makefiles_pins_in_its_order():
    made = [
        step for step in _pip_steps(_makefile_recipe("$(STAMP)"))
        if re.split(r"[=<>]", step[0])[0] not in NOT_IN_IMAGE
    ]
    assert made == [("torch==2.13.0", False), (".", False), ("torchrec==1.8.0", True)]
    assert _pip_steps(_run_commands()) == made


def test_the_image_runs_the_python_and_jdk_of_the_project():
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    (python,) = re.findall(r">=(\d+\.\d+)", requires)
    (base,) = _instructions("FROM")
    assert re.fullmatch(rf"python:{re.escape(python)}-slim(-\w+)?", base)
    (jdk,) = set(re.findall(r"openjdk-\d+-jdk-headless", " ".join(_makefile_recipe("java"))))
    assert any(command.startswith("apt-get install") and jdk in command.split() for command in _run_commands())


def test_the_image_serves_with_the_asgi_engine_on_kserves_ports():
    (entrypoint,) = _instructions("ENTRYPOINT")
    assert json.loads(entrypoint) == ["torchrec-serve", "serve", "--engine", "asgi"]
    (ports,) = _instructions("EXPOSE")
    assert ports.split() == ["8080", "8081"]  # HTTP, gRPC


def test_the_runtimes_args_are_serve_options():
    """The ServingRuntime's container args after the image's entrypoint, as `serve` parses them."""
    parser = argparse.ArgumentParser()
    cli_args.serve_args(parser)
    if "--engine" not in parser.format_help():
        pytest.skip("`torchrec-serve serve` has no --engine yet (the ASGI engine is not merged)")
    runtime = yaml.safe_load((REPO / "examples" / "kserve" / "serving_runtime.yaml").read_text())
    (container,) = runtime["spec"]["containers"]
    args = [arg.replace("{{.Name}}", "criteo") for arg in container["args"]]
    entrypoint = json.loads(_instructions("ENTRYPOINT")[0])
    options, unknown = parser.parse_known_args(entrypoint[2:] + args)
    assert unknown == [], "the ServingRuntime passes options `torchrec-serve serve` does not take"
    assert (options.engine, options.model_store, options.archives) == ("asgi", Path("/mnt/models"), ["criteo.mar"])
    assert (options.port, options.grpc_port, options.workers) == (8080, 8081, 2)  # the image's EXPOSE
