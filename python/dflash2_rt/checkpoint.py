"""Checkpoint inspection (placeholder: being written)."""
from . import _core


def inspect_checkpoint(path):
    return _core.inspect_checkpoint(str(path))
