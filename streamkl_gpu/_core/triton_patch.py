"""The one way streamkl changes a step of Triton: a method wrapped once per process, marked so
that a second install finds it done (``_core/triton_keys.py``, ``_core/triton_launchers.py``,
``_core/triton_interpreter.py``)."""
from __future__ import annotations

import functools


def wrap_once(owner, name: str, marker: str, wrap) -> bool:
    """Replace ``owner.name`` by ``wrap(original)`` (with the original's name and docstring) unless
    a wrapper carrying ``marker`` is already there. False where ``owner`` has no such attribute
    (another layout of Triton): nothing is wrapped."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    if getattr(original, marker, False):
        return True
    wrapped = functools.wraps(original)(wrap(original))
    setattr(wrapped, marker, True)
    setattr(owner, name, wrapped)
    return True
