"""Stage 1: ex-situ per-rank tracing into execution graphs (see schema.py for the contract)."""

from trainsim.trace.tracer import TraceResult, rank_class_table, trace_layout

__all__ = ["TraceResult", "rank_class_table", "trace_layout"]
