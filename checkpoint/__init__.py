"""Placeholder; filled in by the package owner."""
