"""The one error type of checkpoint conversion: its message names the problem and the fix."""
from __future__ import annotations


class ConvertError(ValueError):
    """Bad conversion input (architecture, tensors, shapes, paths); nothing was written."""
