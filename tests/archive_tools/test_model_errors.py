"""An exception the user's model raises while the build runs it is the model's, not the
project's: exit 9, one line naming the model's file:line and the batch it ran on."""

import inspect

import orjson
import pytest
import yaml

from archive_tools.cli import main
from tests.archive_tools import model_raising
from tests.archive_tools.model_raising import SPEC

RAISES_AT = next(
    i for i, line in enumerate(inspect.getsource(model_raising).splitlines(), 1) if "raise IndexError" in line
)
WHERE = f"tests/archive_tools/model_raising.py:{RAISES_AT} in forward"


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "one_id.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


def _build(spec_path, tmp_path, capsys, *extra) -> tuple[int, str]:
    code = main(["build", "--spec", str(spec_path), "--seed", "0", "--model-store", str(tmp_path), *extra])
    return code, capsys.readouterr().err.strip().splitlines()[-1]


def test_a_model_that_raises_on_the_generated_requests_is_named_with_the_batch(spec_path, tmp_path, capsys):
    code, line = _build(spec_path, tmp_path, capsys)
    assert code == 9, line
    assert line == (
        "torchrec-serve build: error: the model raised during verification (the float model labelling "
        "generated requests): IndexError: one id per feature, got bags of 0-4 at " + WHERE + ", on a batch "
        "of 1024 items in 64 requests (dense_features [1024, 3]; ids per bag: user 0-4, item 0-4)"
    )


def test_a_model_that_raises_at_capture_is_named_and_eager_builds_on_its_own_requests(spec_path, tmp_path, capsys):
    """Validation requests of one id a bag pass; capture's own example (0-3 ids a bag) does not."""
    lines = [
        {"items": [{"dense": [0.1 * k, 0.2, 0.3], "sparse": {"user": [k], "item": [k + 1]}} for k in range(4)],
         "labels": [0, 1, 0, 1]}
    ]
    validation = tmp_path / "one.jsonl"
    validation.write_bytes(b"\n".join(orjson.dumps(line) for line in lines))
    assert _build(spec_path, tmp_path, capsys, "--validation", str(validation))[0] == 0
    code, line = _build(spec_path, tmp_path, capsys, "--validation", str(validation), "--artifact", "exported")
    assert code == 9, line
    assert line == (
        "torchrec-serve build: error: the model raised during capture: IndexError: one id per feature, got "
        "bags of 0-3 at " + WHERE + ", on a batch of 10 items (dense_features [10, 3]; ids per bag: user 0-3, "
        "item 0-3)"
    )
