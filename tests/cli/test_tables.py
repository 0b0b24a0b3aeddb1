"""The command line's tables show every digit at any terminal width (a table when it fits, blocks of
`name: value unit` lines when it does not), and `--json` prints one parseable document."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from trainsim.cli import main, print_compose
from trainsim.tables import breakdown_rows, memory_rows, search_rows, show

COMPOSE = ["compose", "--quick", "hardware=a100-80g-dgx", "model=gpt-tiny", "parallelism=pp2", "parallelism.tp=2",
           "parallelism.dp=2"]
"""A small point with two pipeline stages and three kinds of communication, built in seconds."""


def printed(width: int, draw) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    draw(console)
    return console.file.getvalue()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A working directory where COMPOSE's trace and profile are built (the tests after the first only compose)."""
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="module")
def prediction(project):
    from trainsim.api import predict

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        return predict(*COMPOSE[2:], build_missing=False)


def test_compose_shows_every_number_at_80_and_200_columns(prediction):
    classes = prediction.summary["classes"]
    assert len(classes) == 2
    for width in (80, 200):
        out = printed(width, lambda console: print_compose(prediction, console))
        assert "…" not in out
        assert f"step {prediction.step_time_s:.4f} s" in out
        for row in classes:
            for key in ("compute_s", "pipeline_bubble_s", "optimizer_step_s"):
                assert f"{row[key]:.4f}" in out, (width, key)
        assert ("compute (s)" in out) == (width == 200)  # a table where it fits, else `compute: 0.0123 s` lines
        assert ("  compute: " in out) == (width == 80)


def test_compose_json_is_one_document_with_the_step_time(prediction, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*COMPOSE, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["step_time_s"] == prediction.step_time_s
    assert [c["compute_s"] for c in document["classes"]] == [c["compute_s"] for c in prediction.summary["classes"]]
    assert document["warnings"] == prediction.warnings


def test_compose_at_80_columns_from_the_command_line(prediction, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(COMPOSE) == 0
    out = capsys.readouterr().out
    assert "…" not in out and f"{prediction.summary['classes'][1]['compute_s']:.4f} s" in out


def test_wide_tables_turn_into_blocks_and_narrow_ones_stay_tables():
    classes = [{"rank_class": c, "ranks": 64, "pp_rank": c, "compute_s": 1.2345 + c, "slowdown_added_s": 0.0123,
                "exposed_comm_s": {"tp": 0.1111, "dp": 0.2222, "pp": 0.0, "ep": 0.3333 * c},
                "pipeline_bubble_s": 0.4444, "idle_s": 0.0, "optimizer_step_s": 0.0555,
                "contention_added_s": 0.0066, "oom": c == 1} for c in range(3)]
    rows = breakdown_rows(3.0, classes)
    assert [f.header for f in rows.fields if f.name.startswith("exposed")] == ["exposed tp (s)", "exposed dp (s)",
                                                                               "exposed ep (s)"]  # no pp: all 0
    for width in (80, 200):
        out = printed(width, lambda console: show(console, rows))
        assert "…" not in out and all(v in out for v in ("3.2345", "0.6666", "0.0066", "OOM", "fits"))
    assert "exposed ep: 0.6666 s" in printed(80, lambda console: show(console, rows))
    memory = [{"rank_class": 0, "parameter_bytes": 2**30, "gradient_bytes": 2**31, "optimizer_state_bytes": 3 * 2**30,
               "peak_activation_bytes": 2**29, "max_inflight_microbatches": 4, "peak_bytes": 7 * 2**30}]
    rows = memory_rows(memory, 80 * 2**30, "a100-80g-dgx")
    assert "peak (GiB)" in printed(200, lambda console: show(console, rows))  # headers on one line
    out = printed(80, lambda console: show(console, rows))  # still a table: headers wrap between words
    assert "┃ activations ┃" in out and "(GiB)" in out and "7.00" in out and "fits" in out and "…" not in out
    layouts = [{"layout": "tp8-pp16-dp8-mb1-1f1b", "step_time_s": 12.3456, "tokens_per_s": 123456.0}]
    out = printed(80, lambda console: show(console, search_rows("layouts", layouts, ["layout", "step_time_s",
                                                                                      "tokens_per_s"])))
    assert "step time (s)" in out and "12.35" in out and "123,456" in out and "…" not in out
