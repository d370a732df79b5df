"""DataParallel's ``compression=`` option, checked against the model it compresses."""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from scaleout.compression import CompressionConfig
from scaleout.compression.config import as_config

__all__ = ["model_compression"]


def model_compression(compression: Any, module: nn.Module, *,
                      distributed_update: bool) -> CompressionConfig | None:
    """``compression`` (a spec, a Codec, a ``{glob: spec}`` dict or a CompressionConfig) as a
    CompressionConfig for ``module``'s gradients; ``None`` for exact gradients.

    Raises:
        ValueError: a bad spec; a lossy codec with ``distributed_update``; a pattern of
            ``layers`` that names none of ``module``'s trainable parameters (a module's name
            without ``.*``, a typo: before stop 49 such a pattern compressed nothing, with
            every byte on the wire, silently).
        TypeError: a spec of the wrong type.
    """
    if compression is None:
        return None
    config = as_config(compression)
    if distributed_update and config.lossy:
        raise ValueError("compression= with distributed_update=True is not supported: the "
                         "sharded update reduce-scatters each gradient and the codecs "
                         "exchange whole buckets; use one or the other")
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    unmatched = [pattern for pattern in config.layers
                 if not any(fnmatch.fnmatchcase(name, pattern) for name in names)]
    if unmatched:
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise ValueError(f"compression: the pattern(s) {', '.join(map(repr, unmatched))} name "
                         f"no trainable parameter of the model (patterns are globs over "
                         f"parameter names: 'encoder.*' for a module's, not 'encoder'); its "
                         f"parameters: {shown}")
    return config
