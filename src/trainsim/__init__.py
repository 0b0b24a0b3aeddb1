"""trainsim: predict the step time of distributed LLM training without the cluster.

    import trainsim
    p = trainsim.predict("model=gpt-175b", "parallelism=pp16-tp8-dp8", hardware="a100-80g-dgx")
"""

from trainsim.version import __version__

__all__ = ["Prediction", "__version__", "predict"]


def __getattr__(name: str):
    """`trainsim.predict` and `trainsim.Prediction` load the API on first use (no work at import time)."""
    if name in ("predict", "Prediction"):
        from trainsim import api

        return getattr(api, name)
    raise AttributeError(f"module 'trainsim' has no attribute {name!r}")
