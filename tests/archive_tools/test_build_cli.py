"""The archive tool's command line refuses inconsistent split options before building anything."""

import pytest

from archive_tools.build import main
from tests.conftest import TINY_SPEC


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sparse", "eager"], "--sparse only apply to --artifact split"),
        (["--dense", "aoti", "--dense-device", "cpu"], "--dense/--dense-device only apply"),
        (["--artifact", "split", "--dense-device", "cuda"], "dense_device: cuda needs dense: exported"),
        (["--artifact", "split", "--dense", "eager"], "invalid choice: 'eager'"),
    ],
)
def test_split_options_are_checked_on_the_command_line(extra, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["--spec", str(TINY_SPEC), "--model-store", str(tmp_path), *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written"
