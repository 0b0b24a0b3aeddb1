"""Which GPUs and shapes the block-scaled precisions accept (config/validate_precision.py)."""

from __future__ import annotations

import pytest

from trainsim.config import compose_run
from trainsim.errors import ConfigError

MXFP8 = ("parallelism.precision=fp8", "parallelism.fp8_recipe=mxfp8")
BLOCKWISE = ("parallelism.precision=fp8", "parallelism.fp8_recipe=blockwise", "model.hidden_size=256",
             "model.seq_length=128")
FP4 = ("parallelism.precision=fp4",)


def test_mxfp8_and_fp4_run_on_blackwell_only_and_blockwise_on_hopper_or_later():
    for recipe in (MXFP8, FP4):
        assert compose_run(["hardware=gb200-nvl72", *recipe]).parallelism.precision in ("fp8", "fp4")
        with pytest.raises(ConfigError, match=r"Blackwell.*device_name 'NVIDIA H100"):
            compose_run(["hardware=h100-sxm-dgx", *recipe])
    for hardware in ("h100-sxm-dgx", "h200-sxm-dgx", "gb200-nvl72"):
        assert compose_run([f"hardware={hardware}", *BLOCKWISE]).parallelism.fp8_recipe == "blockwise"
    with pytest.raises(ConfigError, match=r"'blockwise' needs Hopper or later.*device_name 'NVIDIA A100"):
        compose_run(["hardware=a100-80g-dgx", *BLOCKWISE])
    for recipe in (MXFP8, BLOCKWISE, FP4):  # CPU devices run the emulation and are measured
        compose_run(["hardware=local-cpu", *recipe])


def test_fp4_needs_an_fp4_peak_named_in_the_error():
    with pytest.raises(ConfigError, match=r"hardware.peak_flops_per_s.fp4 \(known: bf16, fp16, fp32, fp8\)"):
        compose_run(["hardware=gb200-nvl72", *FP4, "~hardware.peak_flops_per_s.fp4"])
    with pytest.raises(ConfigError, match=r"parallelism.precision='fp2'.*accepted: .*fp8, fp4"):
        compose_run(["parallelism.precision=fp2"])


@pytest.mark.parametrize(("recipe", "block"), [(MXFP8, 32), (BLOCKWISE, 128), (FP4, 16)])
def test_block_recipes_refuse_widths_and_token_counts_off_their_block(recipe, block):
    compose_run([*recipe, "parallelism=tp2"], check="layout")  # gpt-tiny (blockwise: widened) fits
    with pytest.raises(ConfigError, match=rf"blocks of {block} elements: model.ffn_hidden_size / tp = {block + 8}"):
        compose_run([*recipe, f"model.ffn_hidden_size={block + 8}"], check="layout")
    with pytest.raises(ConfigError, match=rf"blocks of {block} elements: the tokens of a micro-batch"):
        compose_run([*recipe, f"model.seq_length={block + 2}"], check="layout")


def test_block_recipes_refuse_what_is_not_built_and_ring_shards_off_their_block():
    overlap = ("parallelism=tp2", "parallelism.sequence_parallel=true", "parallelism.tp_comm_overlap=true")
    compose_run([*MXFP8, *overlap], check="layout")  # 2 x 64 tokens: 64 per rank, whole blocks of 32
    with pytest.raises(ConfigError, match=r"blocks of 32 elements: the tokens of a micro-batch per tp rank .* = 48"):
        compose_run([*MXFP8, *overlap, "model.seq_length=48"], check="layout")  # 96 tokens fit, 48 per rank not
    with pytest.raises(ConfigError, match=r"parallelism.precision='fp4' with experts"):
        compose_run([*FP4, "model.num_experts=4"], check="layout")


def test_rowwise_fp8_with_and_without_async_tp_and_its_refusals_naming_the_fields():
    base = ["hardware=h100-sxm-dgx", "hardware.num_nodes=64", "model=llama3-8b", "parallelism=fsdp64-tp8",
            "parallelism.precision=fp8", "parallelism.fp8_recipe=rowwise"]
    compose_run([*base, "parallelism.tp_comm_overlap=false"])  # torchtitan's 2D FSDP + TP, vanilla TP
    compose_run([*base, "parallelism.tp_comm_overlap=true"])  # torchtitan's async TP: the ring carries bf16
    with pytest.raises(ConfigError, match="fp8_param_gather"):
        compose_run([*base, "parallelism.tp_comm_overlap=false", "parallelism.fp8_param_gather=true"])
    with pytest.raises(ConfigError, match="Hopper"):
        compose_run([*base, "hardware=a100-80g-dgx", "parallelism.tp_comm_overlap=false"])
