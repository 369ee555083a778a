"""bench/charts.py and the runs recorded in bench/results/: every record holds to the
schema and traces to the history section it names, and every chart draws from them.
The records are the only copy of figures measured on machines that are gone, so a
record that stops parsing, or a figure the log never had, fails here rather than in a
chart nobody redraws."""
import copy
import json

import pytest

from bench import charts


@pytest.fixture(scope="module")
def records():
    return charts.load_records()


def test_every_record_loads_and_has_the_common_fields(records):
    files = sorted(p.name for p in charts.RESULTS.glob("*.json"))
    assert [r["_file"] for r in records] == files
    kinds = {r["benchmark"] for r in records}
    assert kinds == set(charts.KINDS)  # each chart has something to draw
    for r in records:
        assert r["session"] > 0 and r["source"].startswith("docs/benchmarks-history.md#")


def test_every_figure_traces_to_its_history_section(records):
    assert charts.check(records) == []


def test_a_figure_the_history_lacks_is_reported(records):
    record = copy.deepcopy(next(r for r in records if r["benchmark"] == "serve"))
    record["results"][0]["output_throughput"] += 0.1
    sections = charts.history_sections(charts.HISTORY.read_text())
    (problem,) = charts.untraced_figures(record, sections)
    assert "output_throughput" in problem


@pytest.mark.parametrize("breakage, message", [
    (lambda r: r.pop("source"), "missing 'source'"),
    (lambda r: r["pairs"][0].update(vllm_tok_s=-1.0), "must be positive"),
    (lambda r: r["pairs"][0].update(ratio=9.99), "ratio"),
    (lambda r: r.update(date="26 Nov"), "YYYY-MM-DD"),
    (lambda r: r.update(benchmark="w2"), "unknown benchmark"),
])
def test_the_schema_refuses_a_broken_record(records, tmp_path, breakage, message):
    record = {k: v for k, v in copy.deepcopy(
        next(r for r in records if r["benchmark"] == "w1")).items() if k != "_file"}
    breakage(record)
    (tmp_path / "broken.json").write_text(json.dumps(record))
    with pytest.raises(charts.RecordError, match=message):
        charts.load_records(tmp_path)


def test_latest_takes_the_newest_run_per_machine_and_path(records):
    newest = {(r["machine"], r["isa"]): r["session"] for r in charts.latest(records, "w1")}
    assert newest[("xeon-amx", "native")] == 18  # session 17's run is older
    served = {(r["machine"], r["isa"]): r["run"] for r in charts.latest(records, "serve")}
    assert served[("zen4", "avx2")] == 3  # session 19's second AVX2 run


def test_every_chart_renders(records, tmp_path):
    written = charts.render_all(records, tmp_path)
    assert sorted(p.name for p in written) == sorted(charts.CHARTS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_the_committed_charts_are_there_and_small():
    for name in charts.CHARTS:
        path = charts.IMAGES / name
        assert path.exists(), f"run python bench/charts.py ({name} is missing)"
        assert path.stat().st_size < 100_000, name
