"""The pipeline driver builds what a point lacks, in the stage graph's order, and nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainsim import pipeline
from trainsim.config import compose_run
from trainsim.registry import STAGES, Stage
from trainsim.trace.stage import tracer_code_digest

COMPOSE_CLOSURE = ["trace", "profile", "calibration", "slowdown_dataset", "slowdown_model", "compose"]


def test_stage_order_follows_the_declared_inputs_not_the_registry_order():
    order = pipeline.stage_order()
    for name, stage in STAGES.items():
        assert all(order.index(u) < order.index(name) for u in (*stage.inputs, *stage.optional_inputs)), name
    backwards = dict(reversed(list(STAGES.items())))  # declared last-first: the order must not come from here
    reordered = pipeline.stage_order(backwards)
    for name, stage in STAGES.items():
        assert all(reordered.index(u) < reordered.index(name) for u in stage.inputs), name
    cycle = {"a": Stage("a", (), "a", "a.py", (), "", inputs=("b",)), "b": Stage("b", (), "b", "b.py", (), "",
                                                                                  inputs=("a",))}
    with pytest.raises(ValueError, match="cycle"):
        pipeline.stage_order(cycle)


def test_every_stage_but_the_on_demand_ones_has_a_builder():
    """A stage added to the registry without a builder would be silently skipped by `trainsim compose`."""
    assert set(pipeline.BUILDERS) == {name for name, stage in STAGES.items() if not stage.on_demand}
    assert all(set(stage.fallback_inputs) <= set(stage.inputs) for stage in STAGES.values())


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """Every builder replaced by one that publishes an empty artifact (a manifest, and what the outdated checks
    read) and records the call: which stages were built, in which order, from which inputs."""
    from trainsim.slowdown.train import HELD_OUT_GROUPS, SCHEMA_VERSION

    monkeypatch.chdir(tmp_path)
    calls: list[tuple[str, dict[str, Path]]] = []

    def builder(name):
        def build(run, inputs, output):
            calls.append((name, dict(inputs)))
            output.mkdir(parents=True, exist_ok=True)
            config = {"tracer_code": tracer_code_digest()} if name == "trace" else {}
            (output / "manifest.json").write_text(json.dumps({"stage": name, "config": config}))
            if name == "slowdown_model":
                (output / "schema.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION}))
                (output / "metrics.json").write_text(json.dumps({HELD_OUT_GROUPS: {}}))
            return {"step_time_s": 1.0} if name == "compose" else None
        return build

    monkeypatch.setattr(pipeline, "BUILDERS", {name: builder(name) for name in pipeline.BUILDERS})
    return calls


@pytest.fixture
def run():
    return compose_run(["model=gpt-tiny", "parallelism=dp2", "hardware=a100-80g-dgx"], check="layout")


def built(calls) -> list[str]:
    names = [name for name, _ in calls]
    calls.clear()
    return names


def test_an_empty_tree_builds_every_input_of_the_compose_in_stage_order(recorded, run):
    summary, out = pipeline.compose_point(run)
    assert built(recorded) == COMPOSE_CLOSURE
    assert summary == {"step_time_s": 1.0} and out == Path(STAGES["compose"].path(run.keys))
    pipeline.compose_point(run)  # everything cached: only the compose itself runs again
    assert built(recorded) == ["compose"]


def test_a_point_whose_trace_exists_builds_only_what_is_missing(recorded, run):
    pipeline.build_point(run, "trace")
    assert built(recorded) == ["trace"]
    pipeline.compose_point(run)
    assert built(recorded) == COMPOSE_CLOSURE[1:]


def test_deleting_the_calibration_rebuilds_it_and_what_reads_it(recorded, run):
    pipeline.compose_point(run)
    built(recorded)
    (pipeline.artifact_paths(run.keys)["calibration"] / "manifest.json").unlink()
    pipeline.compose_point(run)
    assert built(recorded) == ["calibration", "compose"]


def test_a_missing_dataset_under_a_current_model_is_not_rebuilt(recorded, run):
    """A present, current artifact is used as it is: its own inputs are not looked at."""
    pipeline.compose_point(run)
    built(recorded)
    shutil.rmtree(pipeline.artifact_paths(run.keys)["slowdown_dataset"])
    pipeline.compose_point(run)
    assert built(recorded) == ["compose"]


def test_outdated_artifacts_are_rebuilt_with_what_depends_on_them(recorded, run):
    pipeline.compose_point(run)
    built(recorded)
    paths = pipeline.artifact_paths(run.keys)
    (paths["trace"] / "manifest.json").write_text(json.dumps({"config": {"tracer_code": "an older tracer"}}))
    pipeline.compose_point(run)
    assert built(recorded) == ["trace", "profile", "compose"]
    (paths["slowdown_model"] / "schema.json").write_text(json.dumps({"schema_version": 1}))
    pipeline.compose_point(run)
    assert built(recorded) == ["slowdown_dataset", "slowdown_model", "compose"]
    # a model without its score on unseen kernel groups (what use=auto decides on) is retrained, its dataset kept
    (paths["slowdown_model"] / "metrics.json").write_text(json.dumps({"cv": {}}))
    pipeline.compose_point(run)
    assert built(recorded) == ["slowdown_model", "compose"]


def test_quick_builds_only_trace_and_profile_and_composes_from_what_exists(recorded, run):
    pipeline.compose_point(run, build_missing=False)
    calls = list(recorded)
    assert built(recorded) == ["trace", "profile", "compose"]
    assert set(calls[-1][1]) == {"trace", "profile"}  # the compose read no calibration nor slowdown model
    pipeline.compose_point(run)  # the full prediction adds the rest, and the compose reads all four
    calls = list(recorded)
    assert built(recorded) == ["calibration", "slowdown_dataset", "slowdown_model", "compose"]
    assert set(calls[-1][1]) == set(STAGES["compose"].inputs)


def test_the_target_alone_is_built_and_output_moves_only_the_target(recorded, run, tmp_path):
    pipeline.build_point(run, "calibration")
    assert built(recorded) == ["calibration"]
    assert pipeline.build_point(run, "calibration").built == []
    _, out = pipeline.compose_point(run, output=tmp_path / "elsewhere")
    assert out == tmp_path / "elsewhere" and (out / "manifest.json").is_file()
    assert not pipeline.exists(pipeline.artifact_paths(run.keys)["compose"])
    with pytest.raises(ValueError, match="ground_truth"):
        pipeline.build_point(run, "ground_truth")


def test_predict_composes_through_the_driver(recorded, run, monkeypatch):
    """`trainsim.predict` (and so `trainsim compose` and plan) builds through the driver: its builders ran."""
    import trainsim

    monkeypatch.setattr(pipeline, "compose_point", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("driver")))
    with pytest.raises(RuntimeError, match="driver"):
        trainsim.predict("model=gpt-tiny", "parallelism=dp2", "hardware=a100-80g-dgx")


@pytest.mark.slow
def test_real_builders_make_a_quick_point_and_reuse_it(project_copy, monkeypatch):
    """The real stage functions (light hardware copy): a quick compose traces and profiles once; the next
    call composes only."""
    monkeypatch.chdir(project_copy)
    run = compose_run(["model=gpt-tiny", "parallelism=dp2", "hardware=a100-80g-dgx"], check="layout")
    first = pipeline.build_point(run, "compose", build_missing=False, force_target=True)
    assert first.built == ["trace", "profile", "compose"]
    assert first.results["compose"]["step_time_s"] > 0
    again = pipeline.build_point(run, "compose", build_missing=False, force_target=True)
    assert again.built == ["compose"]
    assert again.results["compose"]["step_time_s"] == first.results["compose"]["step_time_s"]


@pytest.mark.slow
def test_a_current_timeline_is_read_not_composed_again(project_copy, monkeypatch):
    """A repeated compose of an unchanged point reads its timeline; edited code (or a replaced built-in
    schedule) composes again."""
    from trainsim.artifacts import store
    from trainsim.timeline import plugins

    monkeypatch.chdir(project_copy)
    monkeypatch.setattr(store, "code_version", lambda: "0.1.0+0123456789ab")  # a clean checkout's commit
    composed = []
    compose = pipeline.BUILDERS["compose"]
    monkeypatch.setitem(pipeline.BUILDERS, "compose", lambda *args: composed.append(1) or compose(*args))
    run = compose_run(["model=gpt-tiny", "parallelism=dp2", "hardware=a100-80g-dgx"], check="layout")
    summary, out = pipeline.compose_point(run, build_missing=False)
    again, _ = pipeline.compose_point(run, build_missing=False)
    assert len(composed) == 1 and again["step_time_s"] == summary["step_time_s"]
    monkeypatch.setattr(plugins, "replaced_builtins", lambda: True)
    pipeline.compose_point(run, build_missing=False)
    assert len(composed) == 2
    monkeypatch.setattr(plugins, "replaced_builtins", lambda: False)
    monkeypatch.setattr(store, "code_version", lambda: "0.1.0+0123456789ab-dirty")  # edited since its commit
    pipeline.compose_point(run, build_missing=False)
    assert len(composed) == 3
