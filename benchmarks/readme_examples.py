"""The numbers the README's tour shows, made by the commands it shows, so that they are generated, not typed.

Each example is a `trainsim compose` point (through `trainsim.predict`, the same driver) or the `trainsim plan` call
of the tour; the README quotes them as `<!--fig NAME-->` spans (`python benchmarks/check_figures.py --write`).
These are predictions, not validations: they change whenever the models do, which is why they are regenerated.

    python benchmarks/readme_examples.py [--only NAME ...]    (minutes: builds calibrations, slowdown models, traces)

prints `figure example_step_seconds_<name> <s> s` per point, `figure example_tokens_per_s_per_gpu_<name>` where the
README compares with a published rate, and `figure example_plan_*` (layout, step, search estimate, MFU, days, cost).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from figures import figure

GPT175B = ["model=gpt-175b", "parallelism=pp16-tp8-dp8", "hardware=a100-80g-dgx"]
MIXTRAL = ["model=mixtral-8x7b", "parallelism=ep8-pp4-dp16", "hardware=h100-sxm-dgx", "hardware.num_nodes=8"]
DEEPSEEK = ["model=deepseek-v3", "parallelism=ep64-pp16-dp128", "hardware=h800-dgx", "hardware.num_nodes=256"]
POINTS = {
    "gpt175b_1024gpu": GPT175B,
    "gpt175b_1024gpu_inter_node_bw2": [*GPT175B, "hardware.what_if.inter_node_bandwidth_scale=2"],
    "gpt175b_1024gpu_straggler1.5": [*GPT175B, "hardware.stragglers=[{ranks:[1],factor:1.5}]"],
    "mixtral_64gpu": MIXTRAL,
    "mixtral_64gpu_zipf1": [*MIXTRAL, "model.moe_routing=zipf:1.0"],
    "deepseek_v3_2048gpu_bf16": DEEPSEEK,
    "deepseek_v3_2048gpu_fp8": [*DEEPSEEK, "parallelism.precision=fp8"],
    "deepseek_v3_2048gpu_fp8_a2a_overlap": [*DEEPSEEK, "parallelism.precision=fp8", "parallelism.moe_a2a_overlap=true"],
}
PER_GPU_RATE = ("deepseek_v3_2048gpu_fp8_a2a_overlap",)  # the README compares it with DeepSeek's reported rate
PLAN = ["plan", *GPT175B, "--gpus", "1024", "train.tokens=3e11"]


def plan_figures() -> None:
    """`trainsim plan` as the tour runs it, its answer read from --json."""
    done = subprocess.run([sys.executable, "-m", "trainsim.cli", *PLAN, "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"trainsim {' '.join(PLAN)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    a = json.loads(done.stdout)
    figure("example_plan_layout", a["layout"], "")
    figure("example_plan_step_seconds", a["step_time_s"], "s")
    figure("example_plan_estimated_step_seconds", a["estimated_step_time_s"], "s")
    figure("example_plan_mfu_pct", a["mfu_pct"], "%", ".1f")
    figure("example_plan_training_days", a["training_days"], "days", ".1f")
    figure("example_plan_training_cost_musd", a["training_cost_usd"] / 1e6, "M USD")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[*POINTS, "plan"], help="run only these examples")
    args = parser.parse_args()
    import trainsim

    for name in args.only or [*POINTS, "plan"]:
        if name == "plan":
            plan_figures()
            continue
        p = trainsim.predict(*POINTS[name])
        figure(f"example_step_seconds_{name}", p.step_time_s, "s")
        if name in PER_GPU_RATE:
            figure(f"example_tokens_per_s_per_gpu_{name}", p.efficiency["tokens_per_s_per_gpu"], "tokens/s", ",.0f")
    return 0


if __name__ == "__main__":
    sys.exit(main())
