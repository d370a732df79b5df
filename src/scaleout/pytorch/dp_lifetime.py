"""What a DataParallel holds outside itself, and its release when the model goes.

A model is dropped without ``close()`` as a DDP model is: one per trial of a sweep, one
rebuilt per epoch. What it installs on the user's module (forward hooks on its layers,
a post-accumulate-grad hook on each parameter, hooks on each forward's output graph) holds it
only weakly (:func:`weakly`, :func:`weak_method`): torch keeps a parameter's hooks in C++,
where the garbage collector cannot see the cycle through them, and the user's module may
outlive the model anyway. Once the model is collected, its :class:`Holdings` are released
as ``close()`` releases them: the hooks are removed (they do nothing meanwhile), the progress
thread stops and the session's and the buffer average's process groups are freed.

Since stop 52: each dropped model stayed for good, with its progress thread, its lanes'
gloo groups (a socket per peer, two threads each) and its buckets (trials 2 to 20 at 2
ranks: +54 threads, +18 descriptors, +18 process groups in every rank).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Holdings", "weakly", "weak_method"]


def weakly(owner: Any, function: Callable[..., Any]) -> Callable[..., Any]:
    """A hook calling ``function(owner, *args)`` while ``owner`` lives, and doing nothing
    (returning ``None``: inputs, outputs and gradients unchanged) after."""
    ref = weakref.ref(owner)

    def hook(*args: Any) -> Any:
        model = ref()
        return None if model is None else function(model, *args)
    return hook


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling the bound ``method`` while its object lives; ``None`` after."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)
    return call


class Holdings:
    """A model's hook handles, session and duplicated communicators: what :meth:`release`
    (``close()``, or the model's collection) gives back. It never refers to the model."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.session: Any = None
        self.duplicates: list[tuple[Any, Any]] = []  # (distribution, communicator)

    def release(self) -> None:
        """Stop the session's progress thread, free the groups, remove the hooks."""
        try:
            if self.session is not None:
                self.session.close()
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles.clear()
            for distribution, comm in self.duplicates:
                distribution.release(comm)
            self.duplicates.clear()

    def release_when_collected(self, model: Any) -> Callable[[], None]:
        """Release these holdings when ``model`` is collected (not at interpreter exit: a
        model alive then is left as before); the returned call releases them now, once."""
        finalizer = weakref.finalize(model, self.release)
        finalizer.atexit = False
        return finalizer
