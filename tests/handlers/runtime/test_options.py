"""The handler options in an archive's model-config.yaml: parsed once, bad values named."""

import pytest

from handlers.runtime.artifacts import Artifact
from handlers.runtime.options import HandlerOptions
from handlers.runtime.split import SplitPlan


def test_defaults_and_round_trip():
    assert HandlerOptions.from_mapping(None) == HandlerOptions(Artifact.EAGER, None, 1)
    for options in (
        HandlerOptions(Artifact.AOTI, None, 2),
        HandlerOptions(Artifact.SPLIT, SplitPlan(Artifact.EAGER, Artifact.AOTI), 1),
    ):
        assert HandlerOptions.from_mapping(options.to_mapping()) == options


def test_describes_what_runs():
    assert HandlerOptions(Artifact.AOTI).describe() == "aoti (model_aoti.pt2)"
    split = HandlerOptions(Artifact.SPLIT, SplitPlan(Artifact.EAGER, Artifact.AOTI))
    assert split.describe() == "split (sparse weights.pt, dense dense_aoti.pt2 on cpu)"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"artifact": "onnx"}, "artifact: unknown artifact 'onnx'"),
        ({"artifact": "aoti", "intra_op_threads": "4"}, "intra_op_threads: must be a number"),
        ({"metrics_flush_s": -1}, "metrics_flush_s: must be >= 0"),
        ({"intra_op_threads": 0}, "intra_op_threads: must be at least 1"),
        ({"artifact": "split", "dense": "eager"}, "dense: must be one of"),
    ],
)
def test_bad_options_name_the_key(raw, message):
    with pytest.raises(ValueError) as error:
        HandlerOptions.from_mapping(raw)
    assert message in str(error.value)


def test_a_split_plan_only_goes_with_a_split_artifact():
    with pytest.raises(ValueError, match="split"):
        HandlerOptions(Artifact.AOTI, SplitPlan())
    with pytest.raises(ValueError, match="split"):
        HandlerOptions(Artifact.SPLIT, None)


def test_threads_per_forward_follow_its_size():
    options = HandlerOptions(Artifact.AOTI, intra_op_threads=2, parallel_from_items=400)
    assert [options.threads_for(n) for n in (1, 399, 400, 4096)] == [1, 1, 2, 2]
    assert HandlerOptions(Artifact.AOTI, intra_op_threads=2).threads_for(1) == 2  # 0: always
    assert HandlerOptions.from_mapping(options.to_mapping()) == options
