"""``hvd.elastic``: Horovod's elastic training on scaleout's restarts.

Horovod replaces failed workers inside the running job and may add or remove hosts while it
runs. scaleout restarts instead: ``scaleout run --max-restarts K`` starts every rank again
after a failure (the same number of ranks), and :func:`run` resumes the training function
from the state's last ``commit()``, persisted in ``$SCALEOUT_STATE_DIR`` (see
:mod:`scaleout.horovod.elastic_state`). Hosts never change while a job runs, so
``HostsUpdatedInterrupt`` is never raised.

Example:
    >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    >>> @hvd.elastic.run
    ... def train(state):
    ...     for state.epoch in range(state.epoch, epochs):
    ...         ...
    ...         state.commit()
    >>> train(state)        # scaleout run -n 4 --max-restarts 3 train.py
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from scaleout.horovod.elastic_sampler import ElasticSampler
from scaleout.horovod.elastic_state import ObjectState, State, TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``@hvd.elastic.run``: ``func(state, ...)`` resumed from the last commit.

    The decorated function, called with a :class:`State` first, loads the state's last
    persisted commit when there is one (the job was restarted: then the reset callbacks
    run), gives every rank rank 0's state (``state.sync()``) and calls ``func``. A failure
    inside ``func`` ends this attempt (the launcher restarts every rank) instead of
    re-forming the job in this process as Horovod does.

    Raises:
        TypeError: the first argument is not an elastic ``State``.
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"{func.__name__}: the first argument must be an hvd.elastic State "
                            f"(TorchState, ObjectState), got {type(state).__name__}")
        if state.resume():
            state.on_reset()
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper
