"""What the plugin relies on in TorchServe beyond its serving SDK (``Internals.java``,
``Contract.java``): checked on the installed TorchServe by the plugin's own check, run here, and
the one behaviour no name can pin (how ``Model.pollBatch`` starts a batch), read from its bytecode.
A TorchServe upgrade that changes one fails here by name."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from archive_tools import plugin
from archive_tools.plugin import JAR_NAME, PluginBuildError, built_for, plugin_dir, serving_sdk_jar

CONTRACT = "org.torchrecserve.plugin.Contract"


def _java(*args: str) -> subprocess.CompletedProcess:
    classpath = f"{serving_sdk_jar()}:{plugin_dir() / JAR_NAME}"
    return subprocess.run(["java", "-cp", classpath, CONTRACT, *args], capture_output=True, text=True, timeout=60)


def test_the_installed_torchserve_has_what_the_plugin_reaches_into():
    """Model.jobsDb, WorkerThread.req/aggregator/running/currentThread, BatchAggregator.jobs,
    Model.DEFAULT_DATA_QUEUE's value: looked up as the plugin does when TorchServe loads it."""
    done = _java()
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "ok", done.stdout + done.stderr


def test_another_torchserve_version_is_refused_naming_both():
    done = _java("0.13.0")
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1].startswith(
        f"torchrec-serve plugin: built for TorchServe {built_for()}, this server runs 0.13.0"
    )


def test_the_plugin_is_not_built_against_another_torchserve(monkeypatch):
    monkeypatch.setattr(plugin, "installed_torchserve", lambda: "0.13.0")
    with pytest.raises(PluginBuildError, match=rf"written for TorchServe {built_for()}, and TorchServe 0.13.0"):
        plugin_dir()


def test_a_batch_starts_with_a_poll_of_long_max_value():
    """AdmissionQueue knows a batch starts when a worker polls with Long.MAX_VALUE: Model.pollBatch's
    first take (its later takes wait maxBatchDelay, an int of milliseconds)."""
    javap = shutil.which("javap")
    assert javap, "javap (from the JDK that compiles the plugin) reads TorchServe's bytecode"
    done = subprocess.run([javap, "-c", "-p", "-classpath", str(serving_sdk_jar()), "org.pytorch.serve.wlm.Model"],
                          capture_output=True, text=True, check=True)
    body = done.stdout.split("pollBatch(")[1].split("\n\n")[0]
    locked = body.index("lockInterruptibly")  # the model's lock: then the data queue's first take
    first_take = body.index("LinkedBlockingDeque.poll:(JLjava/util/concurrent/TimeUnit;)", locked)
    assert re.search(r"ldc2_w .*long 9223372036854775807l", body[locked:first_take]), body[locked:first_take]
