"""The archive as one object: a .mar read through file by file or a folder, what it says (options,
inputs, table layout), which file holds its tables, and the Java plugin's names for its files."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import yaml

from archive_tools.plugin import SOURCES
from handlers.modeling.registry import input_schema
from handlers.runtime import archive_files
from handlers.runtime.archive import Archive, tables_file_name
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.freshness.layout import TableLayout, TablesLayout
from handlers.runtime.options import HandlerOptions
from handlers.runtime.remote.plan import RemotePlan, ShardRoute
from handlers.runtime.split import SplitPlan

LAYOUT = TablesLayout("ab" * 32, (TableLayout("t_user", "int8", 8, 1000, 12, 0, 0),))


def _folder(root: Path, tiny_spec, options: HandlerOptions, tables: bool = True) -> Path:
    folder = root / "archive"
    folder.mkdir()
    (folder / archive_files.MODEL_CONFIG).write_text(yaml.safe_dump({"handler": options.to_mapping()}))
    input_schema(tiny_spec).save(folder / archive_files.INPUTS)
    tiny_spec.to_yaml(folder / archive_files.SPEC)
    (folder / archive_files.WEIGHTS).write_bytes(b"\0" * 64)
    if tables:
        LAYOUT.save(folder)
    return folder


def _mar(folder: Path) -> Path:
    mar = folder.parent / "tiny.mar"
    with zipfile.ZipFile(mar, "w") as z:
        for file in folder.iterdir():
            z.write(file, file.name)
    return mar


def test_a_mar_is_read_file_by_file_and_its_files_go_with_it(tmp_path, tiny_spec):
    mar = _mar(_folder(tmp_path, tiny_spec, HandlerOptions(Artifact.EAGER)))
    with Archive.open(mar) as archive:
        assert archive.options.artifact == Artifact.EAGER
        assert archive.inputs == input_schema(tiny_spec)
        assert archive.layout == LAYOUT
        assert archive.has(archive_files.WEIGHTS) and not archive.has(archive_files.VERIFICATION)
        assert not (archive.folder / archive_files.WEIGHTS).exists()  # not taken out until asked for
        assert archive.tables_file().read_bytes() == b"\0" * 64
        with pytest.raises(FileNotFoundError, match=r"tiny\.mar: holds no verification\.json"):
            archive.file(archive_files.VERIFICATION)
        folder = archive.folder
        assert archive.unpacked() == folder and (folder / archive_files.SPEC).is_file()
    assert not folder.exists()


def test_a_folder_is_read_in_place(tmp_path, tiny_spec):
    folder = _folder(tmp_path, tiny_spec, HandlerOptions(Artifact.EAGER), tables=False)
    with Archive.open(folder) as archive:
        assert archive.file(archive_files.SPEC) == folder / archive_files.SPEC
        assert archive.layout is None
    assert folder.is_dir()  # nothing of it is removed


def test_an_archive_without_tables_says_why_it_takes_no_row_deltas(tmp_path, tiny_spec):
    remote = HandlerOptions(Artifact.REMOTE, remote=RemotePlan(Artifact.AOTI, (ROUTE,)))
    with Archive.open(_folder(tmp_path, tiny_spec, remote, tables=False)) as archive:
        with pytest.raises(ValueError, match="cannot take deltas: .* its embedding shards do"):
            archive.tables_file()


def test_what_is_not_an_archive_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.mar: no such archive"):
        Archive.open(tmp_path / "nowhere.mar")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt: neither a .mar nor an archive folder"):
        Archive.open(tmp_path / "notes.txt")


ROUTE = ShardRoute("a", "tiny-a", ("user_id",), (8,))


@pytest.mark.parametrize(
    "options, expected",
    [
        (HandlerOptions(Artifact.EAGER), "weights.pt"),
        (HandlerOptions(Artifact.LOOKUPS), "weights.pt"),
        (HandlerOptions(Artifact.AOTI), "model_aoti_weights.pt"),
        (HandlerOptions(Artifact.SPLIT, SplitPlan(sparse=Artifact.AOTI)), "sparse_aoti_weights.pt"),
        (HandlerOptions(Artifact.SPLIT, SplitPlan(sparse=Artifact.EAGER)), "weights.pt"),
        (HandlerOptions(Artifact.EXPORTED), "reads its tables into each worker's memory"),
        (HandlerOptions(Artifact.REMOTE, remote=RemotePlan(Artifact.AOTI, (ROUTE,))), "its embedding shards do"),
    ],
)
def test_the_file_that_holds_the_tables_or_why_none_does(options, expected):
    name, why = tables_file_name(options)
    assert (name == expected) if name is not None else (expected in why)


def test_the_java_plugin_names_the_archive_files_as_python_does():
    """ArchiveFiles.java is the plugin's one place for file names: each equals the Python name."""
    java = (SOURCES / "org" / "torchrecserve" / "plugin" / "ArchiveFiles.java").read_text()
    names = dict(re.findall(r'static final String (\w+) = "([^"]+)";', java))
    assert names and names == {name: getattr(archive_files, name) for name in names}
    for source in SOURCES.rglob("*.java"):  # and no other Java file spells one out
        if source.name != "ArchiveFiles.java":
            code = "\n".join(line for line in source.read_text().splitlines() if not line.lstrip().startswith("*"))
            assert not [n for n in names.values() if f'"{n}"' in code], source.name


def test_a_model_config_that_is_not_yaml_is_named(tmp_path, tiny_spec):
    folder = _folder(tmp_path, tiny_spec, HandlerOptions(Artifact.EAGER))
    (folder / archive_files.MODEL_CONFIG).write_text("handler: [unclosed\n")
    with pytest.raises(InputError, match=r"model-config.yaml is not valid YAML"):
        Archive(folder).options
