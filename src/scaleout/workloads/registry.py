"""Look up a reference workload by name.

Example:
    >>> from scaleout.workloads import get_workload, workload_names
    >>> workload_names()
    ('resnet18', 'resnet50', 'transformer', 'dlrm', 'dlrm-large', 'digits-mlp', 'digits-cnn')
    >>> get_workload("dlrm").default_batch_size
    256
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from scaleout.workloads.base import Workload
from scaleout.workloads.digits import DigitsWorkload
from scaleout.workloads.dlrm import LARGE_TABLE_SIZES, DLRMConfig, DLRMWorkload
from scaleout.workloads.resnet import ResNetWorkload
from scaleout.workloads.transformer import TransformerWorkload

__all__ = ["get_workload", "workload_names"]

_FACTORIES: MappingProxyType[str, Callable[[], Workload]] = MappingProxyType({
    "resnet18": lambda: ResNetWorkload(depth=18),
    "resnet50": lambda: ResNetWorkload(depth=50),
    "transformer": TransformerWorkload,
    "dlrm": DLRMWorkload,
    "dlrm-large": lambda: DLRMWorkload(config=DLRMConfig(table_sizes=LARGE_TABLE_SIZES),
                                       variant="large"),
    "digits-mlp": lambda: DigitsWorkload(model="mlp"),
    "digits-cnn": lambda: DigitsWorkload(model="cnn"),
})


def workload_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_workload`, in a stable order."""
    return tuple(_FACTORIES)


def get_workload(name: str) -> Workload:
    """Return a new reference workload with its default configuration.

    For other configurations construct the class directly, e.g.
    ``DLRMWorkload(config=DLRMConfig(table_sizes=(1000,) * 8))``.

    Args:
        name: one of :func:`workload_names`.

    Returns:
        A fresh :class:`Workload`.

    Raises:
        TypeError: if ``name`` is not a string.
        ValueError: if ``name`` is unknown; the message lists the valid names.
    """
    if not isinstance(name, str):
        raise TypeError(f"workload name must be a str, got {type(name).__name__} ({name!r})")
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; valid names: {', '.join(_FACTORIES)}"
        ) from None
    return factory()
