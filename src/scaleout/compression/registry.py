"""Build codecs from spec strings such as ``"topk:ratio=0.01"`` or ``"cast:bf16"``.

Grammar: ``name`` or ``name:item,item,...`` where each item is ``key=value`` (a
field of the codec's dataclass) or, first only, a bare value for the codec's
main option (``cast:bf16``, ``topk:0.01``, ``powersgd:4``, ``blockquant:128``,
``sign:64``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from scaleout.compression.base import Codec
from scaleout.compression.blockquant import BlockQuantCodec
from scaleout.compression.cast import CastCodec
from scaleout.compression.none import NoneCodec
from scaleout.compression.powersgd import PowerSGDCodec
from scaleout.compression.rows import RowsCodec
from scaleout.compression.sign import SignCodec
from scaleout.compression.topk import TopKCodec

__all__ = ["CODECS", "codec_spec", "make_codec"]

#: Codec classes by spec name.
CODECS: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (NoneCodec, CastCodec, BlockQuantCodec, SignCodec, TopKCodec, PowerSGDCodec, RowsCodec)
}

#: The option a bare value after ``name:`` sets.
_POSITIONAL: dict[str, str] = {
    "cast": "dtype",
    "blockquant": "block_size",
    "sign": "block_size",
    "topk": "ratio",
    "powersgd": "rank",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(codec: str, field: dataclasses.Field, text: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "str")
    try:
        if kind == "bool":
            low = text.lower()
            if low not in _TRUE | _FALSE:
                raise ValueError(text)
            return low in _TRUE
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError as err:
        raise ValueError(f"codec {codec!r}: option {field.name}={text!r} is not a valid {kind}") from err
    return text


def make_codec(spec: str | Codec) -> Codec:
    """Build a codec from a spec string (a :class:`Codec` is returned as is).

    Args:
        spec: e.g. ``"none"``, ``"cast:bf16"``, ``"blockquant"``,
            ``"sign:block_size=64"``, ``"topk:ratio=0.01,momentum=0.9"``,
            ``"powersgd:rank=4"``.

    Returns:
        The codec.

    Raises:
        ValueError: For an unknown codec or option (the message lists the valid
            ones) or an invalid value.
        TypeError: If ``spec`` is neither a string nor a Codec.

    Example:
        >>> make_codec("topk:ratio=0.01,momentum=0.9")
        TopKCodec(ratio=0.01, momentum=0.9, error_feedback=True)
    """
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"codec spec must be a str or a Codec, got {type(spec).__name__}")
    name, sep, rest = spec.strip().partition(":")
    name = name.strip().lower()
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r} in spec {spec!r}; valid codecs: {', '.join(CODECS)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    if sep and not rest.strip():
        raise ValueError(f"codec spec {spec!r}: no options after ':'; write {name!r} for the "
                         f"defaults, or name options (options: {', '.join(fields) or 'none'})")
    items = [item.strip() for item in rest.split(",")] if rest.strip() else []
    for position, item in enumerate(items):
        if not item:
            raise ValueError(f"codec spec {spec!r}: empty option (a stray ',')")
        key, eq, value = item.partition("=")
        if not eq:
            if position or name not in _POSITIONAL:
                raise ValueError(
                    f"codec spec {spec!r}: bare value {item!r} is only allowed first, for "
                    f"codecs {sorted(_POSITIONAL)}; write key=value (options: {', '.join(fields) or 'none'})"
                )
            key, value = _POSITIONAL[name], item
        key = key.strip()
        if key not in fields:
            raise ValueError(
                f"codec {name!r} has no option {key!r}; valid options: {', '.join(fields) or 'none'}"
            )
        if key in kwargs:
            raise ValueError(f"codec spec {spec!r} sets {key!r} twice")
        kwargs[key] = _convert(name, fields[key], value.strip())
    return cls(**kwargs)


def codec_spec(codec: Codec) -> str:
    """The spec string that :func:`make_codec` turns back into ``codec``.

    Args:
        codec: A codec.

    Returns:
        ``name`` followed by the options that differ from their defaults.
    """
    changed = [
        f"{f.name}={getattr(codec, f.name)}"
        for f in dataclasses.fields(codec)
        if getattr(codec, f.name) != f.default
    ]
    return codec.name + (":" + ",".join(changed) if changed else "")
