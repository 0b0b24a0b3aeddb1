"""The docs' figures are the benchmarks' figures: README.md and docs/validation.md agree with benchmarks/results,
every figure the validation table shows is printed by its script, and the recorder keeps what other runs wrote."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import check_figures
import figures
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_and_validation_agree_with_the_results_files():
    """A number typed into README.md or docs/validation.md, or a generated one left stale, fails here: rerun the
    benchmark, then `python benchmarks/check_figures.py --write`."""
    problems = check_figures.figures_not_generated(check_figures.load_results(), check_figures.load_spec())
    assert not problems, "\n".join(map(str, problems))


def printed_name_patterns(script: Path) -> list[re.Pattern]:
    """Every figure name the script can print: its string literals, f-strings with any value in their fields."""
    if script.suffix != ".py":  # .ci/run: names appear literally
        return [re.compile(re.escape(word)) for word in re.findall(r"[a-z][a-z0-9_]+", script.read_text())]
    patterns = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            patterns.append(re.escape(node.value))
        elif isinstance(node, ast.JoinedStr):
            parts = [re.escape(v.value) if isinstance(v, ast.Constant) else "[^ ]*" for v in node.values]
            literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if len(literal) >= 4:  # f"{name}" alone would match anything
                patterns.append("".join(parts))
    return [re.compile(p) for p in patterns]


def test_every_figure_in_the_table_is_printed_by_its_script():
    for group in check_figures.load_spec():
        for row in group["rows"]:
            first = row["script"].split()[0]
            script = ROOT / first if first.startswith(".") else ROOT / "benchmarks" / first
            assert script.exists(), f"benchmarks/figures.yaml: row {row['label']!r}: script {script} does not exist"
            patterns = printed_name_patterns(script)
            for name in check_figures.cell_figures(row):
                assert any(p.fullmatch(name) for p in patterns), \
                    f"benchmarks/figures.yaml: row {row['label']!r} shows {name!r}, which {script.name} never prints"


def test_a_typed_number_is_found_and_inputs_sources_and_code_are_not(tmp_path):
    path = tmp_path / "page.md"
    text = ("The step takes 27.21 s; comm is within 5.9 % (alpha-beta 14.2 %).\n"
            "An 80 GiB GPU, 8 nodes, $5.12 per GPU-hour, `--within-days 60`, <!--given-->10 %<!--/given-->.\n"
            "```\ntrainsim compose  # 3.5 s\n```\n"
            "<!--fig comm_mape_pct_large_all-->5.91 %<!--/fig-->\n")
    found = check_figures.ungenerated_numbers(text, path)
    assert [p.text for p in found] == ["27.21 s", "5.9 %", "14.2 %"]
    assert [p.line for p in found] == [1, 1, 1]


def test_a_span_is_filled_from_the_results_and_a_stale_one_is_reported(tmp_path):
    results = {"comm_accuracy": {"comm_mape_pct_large_all": {"value": 5.91, "unit": "%", "text": "5.91",
                                                             "commit": "abc", "dirty": False, "date": "2026-11-28"}}}
    typed = ("held out: <!--fig comm_mape_pct_large_all-->4.00 %<!--/fig-->; "
             "bare <!--fig comm_mape_pct_large_all:n-->x<!--/fig-->\n")
    generated = check_figures.render_spans(typed, results)
    assert generated == ("held out: <!--fig comm_mape_pct_large_all-->5.91 %<!--/fig-->; "
                         "bare <!--fig comm_mape_pct_large_all:n-->5.91<!--/fig-->\n")
    assert len(check_figures.stale(typed, generated, tmp_path / "README.md")) == 1
    assert check_figures.render_spans(typed, {}).count(check_figures.NOT_MEASURED) == 2


def test_a_run_replaces_its_own_figures_and_keeps_the_others(tmp_path):
    figures.record("bench", "a_pct", 1.234, "%", "1.23", results_dir=tmp_path, argv=["bench.py"])
    figures.record("bench", "b_rows", 7, "rows", "7", results_dir=tmp_path, argv=["bench.py"])
    figures.record("bench", "a_pct", 2.5, "%", "2.50", results_dir=tmp_path, argv=["bench.py", "--only", "a"])
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["script"] == "bench"
    assert {name: entry["value"] for name, entry in document["figures"].items()} == {"a_pct": 2.5, "b_rows": 7}
    entry = document["figures"]["a_pct"]
    assert entry["text"] == "2.50" and entry["argv"] == ["bench.py", "--only", "a"]
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", entry["commit"]) and re.fullmatch(r"\d{4}-\d\d-\d\d", entry["date"])
    assert not list(tmp_path.glob(".bench.*"))  # no temporary file left behind


def test_a_damaged_results_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "bench.json").write_text("{not json")
    with pytest.raises(ValueError, match="bench.json"):
        figures.read_results("bench", tmp_path)


def test_a_benchmark_run_as_a_script_records_and_a_test_calling_it_does_not(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "RESULTS_DIR", tmp_path)
    figures.figure("x_pct", 1.5, "%")  # __main__ is pytest here, as when a test calls a benchmark's main()
    assert capsys.readouterr().out == "figure x_pct 1.50 %\n" and not list(tmp_path.glob("*.json"))
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(figures.BENCHMARKS_DIR / "fake_bench.py"),
                        raising=False)  # a pytest-xdist worker's __main__ has no __file__
    figures.figure("rows", 3, "rows", "d")
    assert capsys.readouterr().out == "figure rows 3 rows\n"
    assert json.loads((tmp_path / "fake_bench.json").read_text())["figures"]["rows"]["value"] == 3
