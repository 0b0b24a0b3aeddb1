"""Whole tables, families and GPUs predicted by fits that never saw them (validation/generalisation.py), on a
synthetic pool whose step times are a known function of the fitted efficiencies."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from trainsim.config import compose_run
from trainsim.validation.generalisation import (
    PooledRows,
    family_of,
    leave_one_family_out,
    leave_one_gpu_out,
    leave_one_table_out,
    transferred_ratios,
)
from trainsim.validation.kernel_fit import FitRow, StepTimes, data_free_params


class KnownSteps(StepTimes):
    """Row i's step: matmul_s[i] at the start's matmul efficiency, memory_s[i] at the start's memory one, each
    scaling as 1/efficiency (no trace, no compose)."""

    def __init__(self, rows, start, matmul_s, memory_s):
        super().__init__(rows, start)
        self.matmul_s, self.memory_s = matmul_s, memory_s

    def compose_one(self, i, params, moved=None):
        scale = {name: self.start[name] / params[name] for name in params}
        if moved is not None:
            scale[moved] *= 1.05
        return self.matmul_s[i] * scale["matmul_efficiency"] + self.memory_s[i] * scale["memory_efficiency"]

    def depends(self, i, name):
        return name != "fp8_matmul_efficiency"


HARDWARE = {"h100": "h100-sxm-dgx", "a100": "a100-80g-dgx", "h200": "h200-sxm-dgx"}
"""pool GPU -> its hardware option (the H200's config carries the H100 SXM's fit)"""


def pool(true_matmul: dict[str, float], rows_per_table: int = 4) -> PooledRows:
    """Two H100 tables, one A100 table and one H200 table; each GPU's rows run at its own true matmul efficiency."""
    hw = {gpu: compose_run([f"hardware={name}"]).hardware for gpu, name in HARDWARE.items()}
    tables = {"t1": ("h100", "llama3-8b"), "t2": ("h100", "gpt-5b"), "t3": ("a100", "llama2-7b"),
              "t4": ("h200", "llama3-8b")}
    frames, fit_rows = [], []
    for table, (gpu, model) in tables.items():
        for k in range(rows_per_table):
            frames.append({"table": table, "label": f"{table}-{k}", "model": model, "gpu": gpu,
                           "hardware": HARDWARE[gpu]})
            fit_rows.append(FitRow(None, None, hw[gpu], None, None))
    rows = pd.DataFrame(frames)
    rows["family"] = [family_of(m) for m in rows["model"]]
    out = PooledRows(rows, fit_rows)
    measured = np.zeros(len(rows))
    for gpu in HARDWARE:
        index = np.flatnonzero(rows["gpu"] == gpu)
        start = data_free_params(hw[gpu])
        rng = np.random.default_rng(len(index))
        matmul_s, memory_s = rng.uniform(1, 2, len(index)), rng.uniform(0.2, 0.5, len(index))
        out.times[gpu] = KnownSteps([fit_rows[i] for i in index], start, matmul_s, memory_s)
        truth = {**start, "matmul_efficiency": true_matmul[gpu]}
        measured[index] = [out.times[gpu].seconds(k, truth) for k in range(len(index))]
    out.rows["measured_s"] = measured
    return out


def test_a_table_is_predicted_by_its_gpus_other_tables_and_never_by_itself():
    truth = {"h100": 0.6, "a100": 0.55, "h200": 0.6}
    predicted = leave_one_table_out(pool(truth)).set_index("label")
    h100 = predicted["table"].isin(["t1", "t2"])
    assert (predicted.loc[h100, "params_from"] == "fit").all()
    assert np.allclose(predicted.loc[h100, "error_pct"], 0, atol=0.5)  # the GPU's truth, learned
    assert (predicted.loc[predicted["table"] == "t3", "params_from"] == "start").all()  # alone on its GPU
    assert (predicted.loc[predicted["table"] == "t3", "error_pct"] < -5).all()  # the data-free start is optimistic
    poisoned = pool(truth)
    poisoned.rows.loc[poisoned.rows["table"] == "t1", "measured_s"] *= 3  # the held-out table's own numbers
    again = leave_one_table_out(poisoned).set_index("label")
    t1 = predicted["table"] == "t1"
    assert np.allclose(again.loc[t1, "predicted_s"], predicted.loc[t1, "predicted_s"])  # not seen by its fold
    assert not np.allclose(again.loc[predicted["table"] == "t2", "predicted_s"],
                           predicted.loc[predicted["table"] == "t2", "predicted_s"])  # t1 fits t2's fold


def test_a_gpu_without_other_rows_gets_the_fit_its_config_carries_without_the_held_out_rows():
    truth = {"h100": 0.6, "a100": 0.55, "h200": 0.6}  # the H200 runs at the H100's efficiency: the same silicon
    tables = leave_one_table_out(pool(truth)).set_index("label")
    t4 = tables["table"] == "t4"
    assert (tables.loc[t4, "params_from"] == "carried from h100").all()
    assert np.allclose(tables.loc[t4, "error_pct"], 0, atol=0.5)  # the H100's fit, as conf/hardware carries it
    families = leave_one_family_out(pool(truth)).set_index("label")
    # Llama held out: the H100's fit to its GPT rows alone carries to the H200's Llama rows
    assert (families.loc[families["table"] == "t4", "params_from"] == "carried from h100").all()
    poisoned = pool(truth)
    poisoned.rows.loc[poisoned.rows["table"] == "t1", "measured_s"] *= 3  # the H100's Llama rows
    again = leave_one_family_out(poisoned).set_index("label")
    assert np.allclose(again.loc[t4, "predicted_s"], families.loc[t4, "predicted_s"])  # same fold: not seen


def test_families_and_gpus_are_held_out_whole():
    truth = {"h100": 0.6, "a100": 0.55, "h200": 0.6}
    families = leave_one_family_out(pool(truth))
    assert set(families["family"]) == {"Llama", "GPT"}
    assert families["error_pct"].notna().all()
    gpus = leave_one_gpu_out(pool(truth)).set_index("label")
    # each GPU at its own ceiling times the other GPU's fitted fraction of its ceiling
    assert (gpus["params_from"] == "other GPUs").all() and gpus["error_pct"].abs().max() < 30


def test_a_gpu_whose_rows_barely_use_a_parameter_carries_little_of_it():
    """The H200's rows spend almost nothing in GEMMs (as the FP8 recipes of Blackwell tables spend little in bf16
    ones), so their fit of the bf16 efficiency wanders; what is carried to the A100 follows the H100, whose rows
    are mostly GEMMs."""
    truth = {"h100": 0.6, "a100": 0.55, "h200": 0.15}
    pooled = pool(truth)
    h200 = pooled.times["h200"]
    h200.matmul_s = h200.matmul_s * 0.01
    pooled.rows.loc[pooled.rows["gpu"] == "h200", "measured_s"] = [
        h200.seconds(k, {**h200.start, "matmul_efficiency": truth["h200"]}) for k in range(len(h200.rows))]
    h100_ratio = pooled.fit_all("h100")["matmul_efficiency"] / pooled.times["h100"].start["matmul_efficiency"]
    h200_ratio = pooled.fit_all("h200")["matmul_efficiency"] / h200.start["matmul_efficiency"]
    carried = transferred_ratios(pooled, ["h100", "h200"])["matmul_efficiency"]
    assert h200_ratio < 0.5 * h100_ratio  # the loosely-used parameter fitted far off
    assert carried == pytest.approx(h100_ratio, rel=0.03)  # and carried with little weight
    assert carried < h100_ratio  # but some


@pytest.mark.parametrize("model, family", [("llama3-70b", "Llama"), ("LLAMA2-13B", "Llama"), ("GPT3-175B", "GPT"),
                                           ("1.7B", "GPT"), ("deepseek-v3", "DeepSeek"), ("Nemotron-340B", "Nemotron"),
                                           ("nemotron4-15b", "Nemotron"), ("mixtral-8x22b", "Mixtral"),
                                           ("kimi-k2", "Kimi"), ("gpt-oss-120b", "GPT-OSS")])
def test_model_families(model, family):
    assert family_of(model) == family

