"""Artifacts written atomically with a manifest, and verified when read."""

from trainsim.artifacts.store import atomic_artifact, is_current, read_manifest, read_table

__all__ = ["atomic_artifact", "is_current", "read_manifest", "read_table"]
