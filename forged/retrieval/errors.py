"""The index's one error, shared by its store and its source side."""

from __future__ import annotations


class IndexError_(Exception):
    """An index that cannot be created, found or read; the message names it."""
