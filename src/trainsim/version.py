"""trainsim's release, which every artifact manifest records (kept equal to pyproject.toml's `version`)."""

__version__ = "0.1.0"
