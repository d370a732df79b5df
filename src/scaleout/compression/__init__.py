"""Gradient compression with error feedback: one codec per file, a tiny contract.

A codec encodes a gradient into a payload plus context and decodes it back;
``summable`` codecs are reduced with an allreduce, the rest are gathered.
:func:`compressed_allreduce` exchanges one tensor (or bucket) over a group and
returns a request; :class:`Compressor` picks a codec per tensor and owns the
error-feedback states. See docs/compression.md.

Example:
    >>> from scaleout.compression import Compressor, CompressionConfig
    >>> comp = Compressor(CompressionConfig(codec="topk:ratio=0.01", min_numel=1024))
    >>> req = comp.allreduce("fc.weight", grad, d, group=GroupType.DATA)  # doctest: +SKIP
    >>> req.wait(timeout=60); req.stats.wire_ratio                        # doctest: +SKIP
"""

from scaleout.compression.base import Codec, ExchangeGenerator, TensorMeta
from scaleout.compression.blockquant import BlockQuantCodec
from scaleout.compression.cast import CastCodec
from scaleout.compression.exchange import (
    CompressedRequest,
    ExchangeStats,
    compressed_allreduce,
    generic_exchange,
    wire_bytes,
)
from scaleout.compression.momentum import MomentumCodec
from scaleout.compression.none import NoneCodec
from scaleout.compression.config import CompressionConfig, Compressor, as_config
from scaleout.compression.powersgd import PowerSGDCodec
from scaleout.compression.registry import CODECS, codec_spec, make_codec
from scaleout.compression.rows import RowsCodec
from scaleout.compression.sign import SignCodec
from scaleout.compression.state import CodecState
from scaleout.compression.topk import TopKCodec

__all__ = [
    "CODECS",
    "BlockQuantCodec",
    "CastCodec",
    "Codec",
    "CodecState",
    "CompressedRequest",
    "CompressionConfig",
    "Compressor",
    "ExchangeGenerator",
    "ExchangeStats",
    "MomentumCodec",
    "NoneCodec",
    "PowerSGDCodec",
    "RowsCodec",
    "SignCodec",
    "TensorMeta",
    "TopKCodec",
    "as_config",
    "codec_spec",
    "compressed_allreduce",
    "generic_exchange",
    "make_codec",
    "wire_bytes",
]
