"""The execution-graph contract (DESIGN.md): Parquet schemas of the trace stage's tables.

graph.parquet       one row per recorded op of one rank class, in program order
  rank_class        class id (ranks identical up to renaming of group members share it)
  id                event id, program order within the class (0-based)
  phase             'forward' | 'backward' | 'optimizer', or 'combined.forward' | 'combined.backward' for the two
                    halves of a combined pass (parallelism.moe_a2a_overlap; workloads/combined_passes.py)
  chunk             model chunk (virtual pipeline stage) on this rank
  microbatch        micro-batch index the op belongs to (always 0 in an ex-situ trace)
  per_microbatch    true: repeat for every micro-batch; false: once per step (DP sync, optimizer)
  kind              'compute' | 'collective' | 'p2p' | 'memcpy'
  stream            'compute', 'comm.<group_kind>' or 'memcpy'
  op                aten / c10d op name, e.g. 'aten::mm'
  input_shapes      JSON list of the op's tensor-argument shapes, in argument order
  input_strides     JSON list of their strides (the memory layout a replay must reproduce)
  input_dtypes      comma-separated dtypes of the tensor arguments (fp32, bf16, int64, ...)
  op_args           JSON {"args", "kwargs"}: tensors as {"$t": i}, dtypes as {"$dtype": name}, scalars kept;
                    with the kernel notes the tracing device's arguments do not show (observer.kernel_notes):
                    "comm_sms" / "comm_kernel" where the op overlaps communication the way Transformer Engine
                    runs it, "dropout_p" for fused attention that drops probabilities in its kernel, "fused" for
                    work done inside the kernel that produced the op's input (TE's FP8 cast: amax, transpose)
  signature         16-hex hash of (op, shapes, strides, dtypes, args): the profile database key
  no_kernel         true for views and allocations (no device kernel; zero time)
  flops             floating-point operations (matmul-class exact, others one per output element)
  bytes_moved       bytes read and written by the op (inputs + outputs)
  collective        all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, barrier,
                    send, recv; null for compute
  group_kind        a kind of parallel.layout.GROUP_KINDS or EXPERT_GROUP_KINDS, 'world' or 'other' (null for
                    compute)
  group_ranks       global ranks of the process group (of the class's representative rank)
  message_bytes     nccl-tests size: all-gather output, reduce-scatter input, all-to-all the larger of what
                    the rank sends and receives (uneven MoE splits), else the buffer
  comm_dtype        dtype of the communicated tensor
  peer              global rank of the other side of a send/recv, else -1
  async_op          communication the step waits for only where it reads the result (isend/irecv of a
                    ring exchange); false: a blocking call (recv, collectives) or compute
  deps              ids of the events that last wrote a storage this op reads

rank_classes.parquet  one row per rank: rank, rank_class, dp_rank, tp_rank, pp_rank, cp_rank
memory.parquet        one row per class: see trainsim.trace.memory.MEMORY_COLUMNS
"""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

GRAPH_SCHEMA = pa.schema([
    ("rank_class", pa.int32()),
    ("id", pa.int64()),
    ("phase", pa.string()),
    ("chunk", pa.int32()),
    ("microbatch", pa.int32()),
    ("per_microbatch", pa.bool_()),
    ("kind", pa.string()),
    ("stream", pa.string()),
    ("op", pa.string()),
    ("input_shapes", pa.string()),
    ("input_strides", pa.string()),
    ("input_dtypes", pa.string()),
    ("op_args", pa.string()),
    ("signature", pa.string()),
    ("no_kernel", pa.bool_()),
    ("flops", pa.int64()),
    ("bytes_moved", pa.int64()),
    ("collective", pa.string()),
    ("group_kind", pa.string()),
    ("group_ranks", pa.list_(pa.int32())),
    ("message_bytes", pa.int64()),
    ("comm_dtype", pa.string()),
    ("peer", pa.int32()),
    ("async_op", pa.bool_()),
    ("deps", pa.list_(pa.int64())),
])

RANK_CLASS_SCHEMA = pa.schema([
    ("rank", pa.int32()),
    ("rank_class", pa.int32()),
    ("dp_rank", pa.int32()),
    ("tp_rank", pa.int32()),
    ("pp_rank", pa.int32()),
    ("cp_rank", pa.int32()),
])


def events_table(events: pd.DataFrame, rank_class: int) -> pa.Table:
    """Recorder events of one class (a DataFrame of its event dicts) as a table of GRAPH_SCHEMA."""
    if "async_op" not in events:
        events = events.assign(async_op=False)
    return pa.Table.from_pandas(events.assign(rank_class=rank_class)[GRAPH_SCHEMA.names], schema=GRAPH_SCHEMA,
                                preserve_index=False)
