"""The `trainsim` command: what a user sees for good and bad input."""

from __future__ import annotations

import argparse

import pytest

from trainsim.artifacts import read_manifest
from trainsim.cli import main


def test_config_prints_composed_values_and_keys(capsys):
    assert main(["config", "parallelism=tp2", "model=gpt-small"]) == 0
    out = capsys.readouterr().out
    assert "hidden_size: 768" in out and "tp: 2" in out
    assert "'parallelism': 'tp2'" in out and "world size 2" in out


def test_trace_writes_artifact_and_memory_verdict(tmp_path, capsys):
    out_dir = tmp_path / "trace"
    assert main(["trace", "model=gpt-175b", "parallelism=pp12-tp8-dp1", "parallelism.recompute=none",
                 "parallelism.micro_batch_size=4", "hardware=h800-dgx", "--output", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "96 ranks in 12 class(es)" in out
    # without recompute, 12 in-flight micro-batches of 4 x 2048 tokens do not fit the first stage in 80 GiB,
    # while the last stage (one in flight) does
    assert "OOM" in out and "fits" in out
    assert read_manifest(out_dir)["config_keys"]["parallelism"].startswith("pp12-tp8-dp1-")


def test_bad_input_exits_2_with_the_reason(capsys):
    assert main(["trace", "model=gpt-9000"]) == 2
    assert "Available options in 'model'" in capsys.readouterr().err
    assert main(["config", "parallelism.tp=3"]) == 2
    assert "choose tp among 1, 2, 4" in capsys.readouterr().err
    assert main(["run", "hardware=a100-80g-dgx"]) == 2
    assert "use hardware=local-cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_run_measures_real_steps(capsys):
    assert main(["run", "--steps", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 0:" in out and "rank 1:" in out and "step time" in out


def test_dvc_yaml_check(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert main(["dvc-yaml", "--check"]) == 0


def test_profile_fit_and_import(tmp_path, monkeypatch, capsys, repo, rate_ops):
    import shutil

    from trainsim.config import compose_run
    from trainsim.profile.database import ProfileDatabase
    from trainsim.profile.stage import profile_ops

    monkeypatch.chdir(tmp_path)
    shutil.copytree(repo / "conf", tmp_path / "conf")
    assert main(["profile-fit"]) == 2
    assert "no measured kernels for hardware 'local-cpu'" in capsys.readouterr().err

    elsewhere = ProfileDatabase(tmp_path / "elsewhere")
    profile_ops(rate_ops, compose_run(["parallelism=tp2"]).hardware, "local-cpu", elsewhere)
    assert main(["profile-import", str(elsewhere.path)]) == 0
    assert f"imported {len(rate_ops)} new row(s)" in capsys.readouterr().out
    assert main(["profile-fit"]) == 0
    out = capsys.readouterr().out
    assert "held out" in out and "kernel_model:" in out and "matmul_half_flops" in out


def _verbs() -> list[str]:
    """The subcommands build_parser() defines, read from the parser itself."""
    from trainsim.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_every_verb_help_shows_an_example(capsys):
    """A new verb without an example in its --help fails here (examples live in cli.EXAMPLES)."""
    verbs = _verbs()
    assert len(verbs) >= 8
    for verb in ["", *verbs]:  # "": the top-level `trainsim --help`
        with pytest.raises(SystemExit) as exit_:
            main([verb, "--help"] if verb else ["--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: trainsim"), verb
        lines = out.splitlines()
        start = next((i for i, line in enumerate(lines) if line.lower().startswith("example")), None)
        assert start is not None, f"`trainsim {verb} --help` has no examples"
        examples = [line.strip() for line in lines[start + 1:] if line.startswith("  trainsim ")]
        assert examples and all(line.startswith(f"trainsim {verb}".rstrip()) for line in examples), (verb, examples)


def test_help_examples_are_valid_commands():
    """Every example parses, and its Hydra overrides compose to a valid layout (config names exist)."""
    import shlex

    from trainsim.cli import EXAMPLES, parse_args
    from trainsim.config import compose_run

    for line in {line for lines in EXAMPLES.values() for line in lines}:
        words = shlex.split(line.split(">")[0])  # `trainsim dvc-yaml > dvc.yaml`: the shell's redirect
        assert words[0] == "trainsim"
        args = parse_args(words[1:])  # exits on an unknown option
        overrides = [w for w in words[2:] if "=" in w and not w.startswith("-")]
        if getattr(args, "hardware", None):
            overrides.append(f"hardware={args.hardware}")
        if overrides:
            compose_run(overrides, check="layout")


def test_the_critical_path_line_names_host_bound_time():
    from trainsim.cli import critical_path_line

    line = critical_path_line({"by_category": {"comm.tp": 0.1, "compute": 2.0, "host": 0.5, "comm.dp": 0.0}})
    assert line == "critical path: compute 2 s, host-bound 0.5 s, exposed tp 0.1 s"
