"""`ArtifactError`: a training artifact (manifest, graphs, state file) that cannot be used, said by file and key."""

from __future__ import annotations

__all__ = ["ArtifactError"]


class ArtifactError(ValueError):
    """A training artifact's file is missing, corrupt, or not what its manifest (or the caller) expects."""
