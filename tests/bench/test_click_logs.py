"""Public click logs into the planner's input: Criteo files merged without repeats, and a libfm
log turned into a spec and a TSV that the validation reader (an independent reader) takes back."""

import pytest

from archive_tools.validation_data import read_validation
from benchmarks.click_logs import ClickLogError, libfm_to_criteo, merge_criteo
from handlers.modeling.registry import load_spec
from benchmarks.scenarios import MODELS

_INTEGERS = ["1", "", "5", "0", "1382", "4", "15", "2", "181", "1", "2", "", "2"]


def _criteo(label: str, first_id: str, integers: list[str] = _INTEGERS) -> list[str]:
    return [label, *integers, first_id, *(format(i, "x") for i in range(25))]


def test_criteo_files_merge_into_one_tsv_each_line_once_integers_as_integers(tmp_path):
    tsv, csv = tmp_path / "head.txt", tmp_path / "sample.csv"
    tsv.write_text("".join("\t".join(_criteo(y, f)) + "\n" for y, f in (("0", "68fd1e64"), ("1", "05db9164"))))
    header = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
    as_floats = [f"{v}.0" if v else v for v in _INTEGERS]  # the first line again, integers written as floats
    csv.write_text("\n".join(",".join(r) for r in (header, _criteo("0", "68fd1e64", as_floats), _criteo("1", "aa"))) + "\n")
    merged = merge_criteo([tsv, csv], tmp_path / "merged.tsv")
    assert merged.lines_read == {str(tsv): 2, str(csv): 2} and merged.distinct == 3
    data = read_validation(merged.path, load_spec(MODELS / "criteo.yaml"))
    assert data.labels == [[0, 1, 1]]
    items = data.requests[0]["items"]
    assert [item["sparse"]["cat_0"] for item in items] == [[0x68FD1E64], [0x05DB9164], [0xAA]]


def test_a_criteo_line_with_a_fraction_is_refused_naming_the_line(tmp_path):
    (tmp_path / "bad.txt").write_text("\t".join(_criteo("0", "1", ["1.5", *_INTEGERS[1:]])) + "\n")
    with pytest.raises(ClickLogError, match="bad.txt:1: field 2: must be an integer, got '1.5'"):
        merge_criteo([tmp_path / "bad.txt"], tmp_path / "merged.tsv")


def test_a_libfm_log_becomes_a_table_per_field_its_ids_in_order_and_labels_0_1(tmp_path):
    (tmp_path / "toy.a.libfm").write_text("-1 7:1 100:1 205:1\n1 3:1 100:1 201:1\n")
    (tmp_path / "toy.b.libfm").write_text("1 7:1 104:1 205:1\n")
    spec_path, tsv = libfm_to_criteo(sorted(tmp_path.glob("*.libfm")), tmp_path / "out", "toy", ("user", "item", "city"))
    spec = load_spec(spec_path)
    assert [(t.name, t.rows, t.features) for t in spec.tables] == [
        ("t_user", 2, ("user",)), ("t_item", 2, ("item",)), ("t_city", 2, ("city",))]
    assert spec.dense_features == 1
    data = read_validation(tsv, spec)
    assert data.labels == [[0, 1, 1]]
    items = data.requests[0]["items"]
    assert [[item["sparse"][f][0] for f in ("user", "item", "city")] for item in items] == [[1, 0, 1], [0, 0, 0], [1, 1, 1]]
    assert len({tuple(item["dense"]) for item in items}) == 1  # the one constant dense feature


@pytest.mark.parametrize("line, message", [
    ("2 1:1 2:1", "label: must be -1, 0 or 1, got '2'"),
    ("1 1:1", "one id per field: 2 fields, got 1 ids"),
    ("1 1:0.5 2:1", "'1:0.5': must be index:1"),
])
def test_a_libfm_line_that_is_not_one_id_per_field_is_refused(tmp_path, line, message):
    (tmp_path / "bad.libfm").write_text(line + "\n")
    with pytest.raises(ClickLogError, match=f"bad.libfm:1: {message}".replace("(", r"\(").replace(")", r"\)")):
        libfm_to_criteo([tmp_path / "bad.libfm"], tmp_path / "out", "bad", ("a", "b"))
