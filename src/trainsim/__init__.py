"""trainsim: predict the step time of distributed LLM training without the cluster."""

__version__ = "0.1.0"
