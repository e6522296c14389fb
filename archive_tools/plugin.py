"""The project's TorchServe plugin: Java sources that ship with the package (``plugin/java``),
compiled against the serving SDK inside the installed torchserve wheel and packaged as a jar that
TorchServe loads from ``plugins_path``.

    plugin_dir()   # -> .../archive_tools/plugin/build, holding torchrec-serve-plugin.jar

The jar is built on first use (``make setup`` builds it), and again whenever the sources or
TorchServe change. What the plugin does is in the Java sources' docs: TorchServe's ``/models``
management API with drained scale-down and a locked model store, admission control with clear
503s, a watchdog for hung workers, and a ``/ping`` that reflects them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "plugin" / "java"
BUILD = Path(__file__).resolve().parent / "plugin" / "build"
JAR_NAME = "torchrec-serve-plugin.jar"
ENDPOINTS = (
    "org.torchrecserve.plugin.ModelsEndpoint",
    "org.torchrecserve.plugin.PingEndpoint",
    "org.torchrecserve.plugin.FreshnessEndpoint",
)
SERVICE_FILE = "META-INF/services/org.pytorch.serve.servingsdk.ModelServerEndpoint"


class PluginBuildError(RuntimeError):
    """javac is missing or the sources do not compile against this TorchServe."""


def serving_sdk_jar() -> Path:
    """TorchServe's frontend jar (it holds the serving SDK), from the installed torchserve wheel."""
    import ts

    return Path(ts.__file__).resolve().parent / "frontend" / "model-server.jar"


def built_for() -> str:
    """The TorchServe version the plugin's sources are written against (``Contract.java``)."""
    contract = (SOURCES / "org" / "torchrecserve" / "plugin" / "Contract.java").read_text()
    match = re.search(r'static final String TORCHSERVE = "([^"]+)";', contract)
    assert match is not None, "Contract.java names the TorchServe it is built for"
    return match.group(1)


def installed_torchserve() -> str:
    return importlib.metadata.version("torchserve")


def plugin_dir() -> Path:
    """The folder for ``plugins_path``, with the jar built and current."""
    installed = installed_torchserve()
    if installed != built_for():
        raise PluginBuildError(
            f"the plugin is written for TorchServe {built_for()}, and TorchServe {installed} is installed; "
            f"install torchserve=={built_for()}"
        )
    jar = BUILD / JAR_NAME
    digest = _digest()
    stamp = BUILD / f"{JAR_NAME}.sha256"
    if not (jar.is_file() and stamp.is_file() and stamp.read_text() == digest):
        _build(jar, stamp, digest)
    return BUILD


def _digest() -> str:
    sha = hashlib.sha256(serving_sdk_jar().read_bytes())
    for source in sorted(SOURCES.rglob("*.java")):
        sha.update(source.relative_to(SOURCES).as_posix().encode())
        sha.update(source.read_bytes())
    return sha.hexdigest()


def _javac() -> str:
    home = os.environ.get("JAVA_HOME")
    candidates = [str(Path(home) / "bin" / "javac")] if home else []
    candidates.append(shutil.which("javac") or "")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise PluginBuildError(
        "javac not found: the TorchServe plugin is compiled from source; install a JDK 17 "
        "(e.g. apt-get install openjdk-17-jdk-headless) or set JAVA_HOME"
    )


def _build(jar: Path, stamp: Path, digest: str) -> None:
    BUILD.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="plugin-", dir=BUILD) as tmp:
        classes = Path(tmp) / "classes"
        sources = [str(p) for p in sorted(SOURCES.rglob("*.java"))]
        command = [_javac(), "--release", "17", "-nowarn", "-proc:none", "-cp", str(serving_sdk_jar()),
                   "-d", str(classes), *sources]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise PluginBuildError(f"the TorchServe plugin does not compile:\n{result.stderr}")
        staged = Path(tmp) / JAR_NAME
        with zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as out:
            out.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: torchrec-serve\n\n")
            out.writestr(SERVICE_FILE, "".join(f"{name}\n" for name in ENDPOINTS))
            for path in sorted(classes.rglob("*.class")):
                out.write(path, path.relative_to(classes).as_posix())
        os.replace(staged, jar)  # atomic: a server starting now sees the old jar or the new one
    stamp.write_text(digest)
