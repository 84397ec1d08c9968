"""Device-function calls under the Triton interpreter without patching ``triton.language`` again.

Under ``TRITON_INTERPRET=1`` a launch (``GridExecutor.__call__``) patches the language modules its
kernel sees (``tl``, ``tl.core``: every builtin wrapped for NumPy, ``range``, ``reduce``...) for
the launch and restores them after it. Triton 3.9's interpreter then patches them *again* at every
call of a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__`` runs
``_patch_lang``: ``inspect.getmembers`` over four modules), into a scope it never restores.
Inside a launch that already patched the helper's modules this changes nothing (each attribute
gets a new but identical wrapper, or none: a wrapper is no longer a builtin), and it is where a
third of an interpreted test's time went (a varlen test: 20 s of 57 s, 13 000 helper calls).

:func:`install` makes such a call skip the repeated patching when the launch in progress has
already patched every language module the helper's globals hold; any other call (outside a launch,
or a helper that sees a module the kernel did not) runs the interpreter's own code. It installs
only on the interpreter it was written against (the source of ``InterpretedFunction.__call__`` is
compared); elsewhere it leaves Triton alone and returns False. A testing aid, like
:mod:`streamkl_gpu.devtools.bounds`: results are the same with and without it
(``tests/test_interpreter_calls.py``).
"""
from __future__ import annotations

import inspect
import textwrap
import threading

__all__ = ["install", "uninstall", "installed", "stats"]

# the body this module replaces (triton 3.9's InterpretedFunction.__call__), as inspect returns it
_EXPECTED_CALL = '''\
def __call__(self, *args, **kwargs):
    # This is a device function call
    _patch_lang(self.fn)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e
'''

_state = threading.local()  # .launches: per launch in progress, the language modules patched for it
_lock = threading.Lock()
_saved: dict | None = None
_counts = {"skipped": 0, "patched": 0}


def stats() -> dict:
    """Helper calls since install that skipped the repeated patching, and those that patched."""
    return dict(_counts)


def _langs(fn, tl) -> frozenset:
    """The language modules ``_patch_lang(fn)`` patches: those of ``tl``, ``tl.core`` that
    ``fn``'s globals hold (the interpreter's rule, ``inspect.ismodule(v) and v in [tl, tl.core]``)."""
    core = tl.core
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is core)


def _launches() -> list:
    if not hasattr(_state, "launches"):
        _state.launches = []
    return _state.launches


def install() -> bool:
    """Patch the interpreter (idempotent); False, and nothing changed, on a Triton whose
    ``InterpretedFunction.__call__`` is not the one this module was written against."""
    global _saved
    import triton.language as tl
    from triton.runtime import interpreter as ti

    with _lock:
        if _saved is not None:
            return True
        try:
            source = textwrap.dedent(inspect.getsource(ti.InterpretedFunction.__call__))
        except (OSError, TypeError):
            return False
        if source != _EXPECTED_CALL or not callable(getattr(ti, "_patch_lang", None)):
            return False
        saved = {"device_call": ti.InterpretedFunction.__call__, "patch_lang": ti._patch_lang}

        def patch_lang(fn):
            """The interpreter's own, called by a launch (GridExecutor, which restores the scope
            when the launch ends) or by a helper call that could not skip it (never restored)."""
            scope = saved["patch_lang"](fn)
            launches = _launches()
            if getattr(_state, "device_call", False):
                if launches:  # a helper's scope is never restored: its patches hold to the launch's end
                    launches[-1].update(_langs(fn, tl))
                return scope
            entry = set(_langs(fn, tl))
            launches.append(entry)
            restore = scope.restore

            def restore_and_forget():
                try:
                    restore()
                finally:
                    for k in range(len(launches) - 1, -1, -1):
                        if launches[k] is entry:
                            del launches[k]
                            break

            scope.restore = restore_and_forget
            return scope

        def device_call(self, *args, **kwargs):
            launches = _launches()
            if not launches or not _langs(self.fn, tl) <= launches[-1]:
                _counts["patched"] += 1
                outer, _state.device_call = getattr(_state, "device_call", False), True
                try:
                    return saved["device_call"](self, *args, **kwargs)
                finally:
                    _state.device_call = outer
            _counts["skipped"] += 1
            fn = self.rewrite()  # the rest of the interpreter's own __call__ (_EXPECTED_CALL)
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise ti.InterpreterError(repr(e)) from e

        ti._patch_lang, ti.InterpretedFunction.__call__ = patch_lang, device_call
        _saved = saved
        return True


def uninstall() -> None:
    """Restore the interpreter's own functions."""
    global _saved
    from triton.runtime import interpreter as ti

    with _lock:
        if _saved is None:
            return
        ti._patch_lang, ti.InterpretedFunction.__call__ = _saved["patch_lang"], _saved["device_call"]
        _saved = None


def installed() -> bool:
    return _saved is not None
