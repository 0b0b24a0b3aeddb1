"""Stage 1: ex-situ per-rank tracing into execution graphs (see schema.py for the contract).

The tracer (torch, FSDP, DTensor: seconds to import) is loaded on first use, so what only reads traces
(compose, report, search's fast path) starts without torch.
"""

__all__ = ["TraceResult", "rank_class_table", "trace_layout"]


def __getattr__(name: str):
    if name in __all__:
        from trainsim.trace import tracer

        return getattr(tracer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
