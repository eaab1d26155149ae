"""scripts/bench_record.py, the one writer of benchmark results: the log gets a line per result,
an area's table holds the latest result per configuration and device, and a broken log or
marker stops it before anything is written."""

import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_record  # noqa: E402

PROSE = "# Benchmarks\n\nIntro.\n\n## Decode\n\nWhat decode measures.\n\n"
MARKED = PROSE + "<!-- bench:decode:begin -->\nstale\n<!-- bench:decode:end -->\n\nProse after the table.\n"


@pytest.fixture
def paths(tmp_path):
    log, markdown = tmp_path / "benchmarks" / "log.jsonl", tmp_path / "BENCHMARKS.md"
    markdown.write_text(MARKED)
    return {"log": log, "markdown": markdown}


def decode(batch: int, tok_s: float, *, device: str = "AMD EPYC (2 cores)", date: str = "2026-11-27") -> dict:
    return bench_record.result(
        "decode",
        {"model": "smollm2-135m", "batch": batch},
        {"decode tok/s": tok_s, "by rows": {"1": 0.5, "8": 12.0}},
        device=device,
        date=date,
        versions={"jax": "0.10.2", "python": "3.11.7"},
        command="python scripts/bench_decode.py | tee out.txt",
        commit="abc1234",
    )


def table_rows(markdown: pathlib.Path, area: str) -> list[list[str]]:
    """The cells of the area's table rows (header and separator left out)."""
    text = markdown.read_text()
    begin, end = f"<!-- bench:{area}:begin -->\n", f"<!-- bench:{area}:end -->"
    body = text[text.index(begin) + len(begin) : text.index(end)].splitlines()
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in body[2:]]


def log_lines(log: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_remeasured_configuration_replaces_its_row_and_every_result_is_logged(paths):
    bench_record.record([decode(1, 60.0), decode(8, 200.0)], **paths)
    bench_record.record([decode(1, 66.7, date="2026-11-28")], **paths)
    rows = table_rows(paths["markdown"], "decode")
    assert [(r[2], r[3]) for r in rows] == [("1", "66.7"), ("8", "200")]  # batch 1 keeps its place
    header = paths["markdown"].read_text().split("<!-- bench:decode:begin -->\n")[1].splitlines()[0]
    assert header == "| device | model | batch | decode tok/s | by rows | date | versions | command |"
    assert rows[0][4:] == ["1: 0.5, 8: 12.0", "2026-11-28", "jax 0.10.2, python 3.11.7"] + [
        "`python scripts/bench_decode.py \\| tee out.txt`"
    ]
    logged = log_lines(paths["log"])
    assert [e["figures"]["decode tok/s"] for e in logged] == [60.0, 200.0, 66.7]
    assert logged[0] | {"figures": None} == decode(1, 60.0) | {"figures": None}
    text = paths["markdown"].read_text()
    assert text.startswith(PROSE) and text.endswith("<!-- bench:decode:end -->\n\nProse after the table.\n")
    assert "stale" not in text


def test_rows_are_per_device_and_an_older_result_recorded_later_does_not_replace_a_newer_one(paths):
    bench_record.record([decode(1, 60.0, date="2026-11-27"), decode(1, 483.0, device="NVIDIA H100")], **paths)
    bench_record.record([decode(1, 50.0, date="2026-11-20")], **paths)
    rows = table_rows(paths["markdown"], "decode")
    assert [(r[0], r[3], r[5]) for r in rows] == [
        ("AMD EPYC (2 cores)", "60.0", "2026-11-27"),
        ("NVIDIA H100", "483", "2026-11-27"),
    ]
    assert len(log_lines(paths["log"])) == 3


def test_an_area_without_markers_gets_a_section_of_its_own_at_the_end(paths):
    toy = bench_record.result(
        "toy", {"case": "a"}, {"ms": 1.5}, device="cpu", date="2026-11-27", versions={}, command=None
    )
    bench_record.record([toy], **paths)
    text = paths["markdown"].read_text()
    assert text.startswith(MARKED.rstrip("\n"))
    assert text.endswith(
        "\n\n## toy\n\n<!-- bench:toy:begin -->\n" + bench_record.table([toy]) + "<!-- bench:toy:end -->\n"
    )
    assert table_rows(paths["markdown"], "toy") == [["cpu", "a", "1.5", "2026-11-27", "–", "–"]]
    bench_record.record([toy | {"figures": {"ms": 2.0}}], **paths)  # the second time into the same section
    assert paths["markdown"].read_text().count("## toy") == 1
    assert table_rows(paths["markdown"], "toy")[0][2] == "2.0"


def test_a_malformed_log_line_is_named_and_nothing_is_written(paths):
    paths["log"].parent.mkdir()
    paths["log"].write_text(json.dumps(decode(1, 60.0)) + "\n{not json\n")
    before = paths["log"].read_text()
    with pytest.raises(ValueError, match=r"log\.jsonl, line 2: not valid JSON"):
        bench_record.record([decode(8, 200.0)], **paths)
    assert paths["log"].read_text() == before and paths["markdown"].read_text() == MARKED


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"kind": "result", "area": "decode", "date": "2026-11-27", "device": "cpu", "figures": {"a": 1}}, "`config`"),
        ({"kind": "guess", "area": "decode", "date": "2026-11-27"}, "kind must be one of result, note"),
        ({"kind": "note", "area": "Decode!", "date": "2026-11-27", "note": "x"}, "area must be lowercase"),
        ({"kind": "note", "area": "decode", "date": "27.11.2026", "note": "x"}, "date must be YYYY-MM-DD"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_log_line_that_is_no_entry_is_named_with_what_is_wrong(paths, entry, message):
    paths["log"].parent.mkdir()
    paths["log"].write_text(json.dumps(entry) + "\n")
    with pytest.raises(ValueError, match=r"line 1: .*" + message):
        bench_record.read_log(paths["log"])


@pytest.mark.parametrize(
    "body, message",
    [
        ("<!-- bench:decode:begin -->\n| old |\n", "has no <!-- bench:decode:end --> after it"),
        ("| old |\n<!-- bench:decode:end -->\n", "without <!-- bench:decode:begin --> before it"),
        ("<!-- bench:decode:end -->\n<!-- bench:decode:begin -->\n", "without <!-- bench:decode:begin -->"),
        (
            "<!-- bench:decode:begin -->\n<!-- bench:decode:end -->\n<!-- bench:decode:begin -->\n"
            "<!-- bench:decode:end -->\n",
            "a second <!-- bench:decode:begin -->",
        ),
        ("<!-- bench:serving:begin -->\n<!-- bench:decode:begin -->\n", "inside the table of 'serving'"),
    ],
)
def test_a_missing_or_misplaced_marker_stops_the_record(paths, body, message):
    paths["markdown"].write_text(PROSE + body)
    with pytest.raises(ValueError, match=r"BENCHMARKS\.md, line \d+: .*" + message.replace("(", r"\(")):
        bench_record.record([decode(1, 60.0)], **paths)
    assert not paths["log"].exists() and paths["markdown"].read_text() == PROSE + body


def test_config_and_figures_keys_must_differ_from_each_other_and_the_fixed_columns():
    kw = {"device": "cpu", "date": "2026-11-27", "versions": {}, "command": None}
    with pytest.raises(ValueError, match=r"\['batch'\]"):
        bench_record.result("decode", {"batch": 1}, {"batch": 2}, **kw)
    with pytest.raises(ValueError, match=r"\['date'\]"):
        bench_record.result("decode", {"batch": 1}, {"date": 2}, **kw)
    with pytest.raises(ValueError, match="non-empty `figures`"):
        bench_record.result("decode", {"batch": 1}, {}, **kw)


def test_notes_are_logged_and_never_make_a_row(paths):
    bench_record.record([decode(1, 60.0)], **paths)
    note = bench_record.add_note("decode", "why batch 8 is slow", section="Where the step goes", log=paths["log"])
    assert log_lines(paths["log"])[-1] == note and note["kind"] == "note"
    bench_record.record([decode(8, 200.0)], **paths)
    assert [r[2] for r in table_rows(paths["markdown"], "decode")] == ["1", "8"]
    with pytest.raises(ValueError, match="a note needs"):
        bench_record.add_note("decode", "", log=paths["log"])


def test_rebuild_writes_every_table_again_from_the_log(paths):
    bench_record.record([decode(1, 60.0), decode(8, 200.0)], **paths)
    bench_record.record([decode(1, 1.0) | {"area": "other"}], **paths)
    recorded = paths["markdown"].read_text()
    hand_edited = recorded.replace("| 200 |", "| 999 |")
    paths["markdown"].write_text(hand_edited)
    assert bench_record.rebuild(**paths) == ["decode", "other"]
    assert paths["markdown"].read_text() == recorded


def test_non_finite_figures_are_logged_as_null_and_shown_as_a_dash(paths):
    entry = decode(1, float("nan"))
    entry["details"] = {"ttft": [float("inf"), 0.5]}
    bench_record.record([entry], **paths)
    [logged] = log_lines(paths["log"])
    assert logged["figures"]["decode tok/s"] is None and logged["details"]["ttft"] == [None, 0.5]
    assert table_rows(paths["markdown"], "decode")[0][3] == "–"


@pytest.mark.parametrize(
    "value, text",
    [(None, "–"), (True, "yes"), (7680, "7,680"), (2517.0, "2,517"), (1658.1, "1,658.1"), (0.0077, "0.0077")]
    + [({"1": 52, "16": 241}, "1: 52, 16: 241"), (["a", 1], "a, 1"), ("x | y\nz", "x \\| y z")],
)
def test_cells(value, text):
    assert bench_record.cell(value) == text


def test_rounded_keeps_a_decimal_below_100_and_none_above():
    assert bench_record.rounded(66.66) == 66.7 and bench_record.rounded(222.4) == 222
    assert bench_record.rounded(0.123456, 2) == 0.12 and bench_record.rounded(3.6, 0) == 4
    assert bench_record.rounded(None) is None and bench_record.rounded(math.nan) is None


def test_the_repository_tables_are_the_log_rendered(tmp_path):
    """docs/BENCHMARKS.md's tables are exactly what its log says: every line of the log is a
    valid entry, and rebuilding the tables changes nothing."""
    log, markdown = ROOT / "docs" / "benchmarks" / "log.jsonl", tmp_path / "BENCHMARKS.md"
    entries = bench_record.read_log(log)
    assert {e["kind"] for e in entries} == {"result", "note"}
    markdown.write_text((ROOT / "docs" / "BENCHMARKS.md").read_text())
    bench_record.rebuild(log=log, markdown=markdown)
    assert markdown.read_text() == (ROOT / "docs" / "BENCHMARKS.md").read_text()


def test_the_command_line_rebuilds_and_adds_notes(paths, monkeypatch, capsys):
    monkeypatch.setattr(bench_record, "LOG", paths["log"])
    monkeypatch.setattr(bench_record, "MARKDOWN", paths["markdown"])
    argv = ["note", "decode", "a finding", "--section", "Title", "--device", "cpu", "--date", "2026-11-27"]
    assert bench_record.main(argv) == 0
    assert log_lines(paths["log"]) == [
        {
            "kind": "note",
            "area": "decode",
            "date": "2026-11-27",
            "section": "Title",
            "device": "cpu",
            "note": "a finding",
        }
    ]
    bench_record.record([decode(1, 60.0)], **paths)
    paths["markdown"].write_text(MARKED)
    assert bench_record.main(["rebuild"]) == 0
    assert table_rows(paths["markdown"], "decode")[0][3] == "60.0"
    assert bench_record.main(["note", "decode", "x", "--date", "yesterday"]) == 1
    assert "date must be YYYY-MM-DD" in capsys.readouterr().err
