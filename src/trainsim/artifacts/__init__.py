"""Artifacts written atomically with a manifest, and verified when read."""

from trainsim.artifacts.store import atomic_artifact, read_manifest, read_table

__all__ = ["atomic_artifact", "read_manifest", "read_table"]
