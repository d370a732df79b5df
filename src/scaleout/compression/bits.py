"""Booleans packed eight to a byte, least significant bit first: sign's signs and the rows
codec's row flags on the wire.

On the CPU numpy's ``packbits``/``unpackbits`` do it (11.2M flags: 0.6 ms against 2.4 ms for
the tensor arithmetic below; DLRM's 77,776 row flags: 4 and 12 us against 22 and 95 us;
benchmarks/RESULTS.md, stop 40). Elsewhere (CUDA) eight bytes are read as one int64 and
gathered with one multiplication, and unpacked with a 256-row table. Both give the same bytes.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

__all__ = ["bit_table", "pack_bits", "unpack_bits"]

# Eight 0/1 bytes read as one little-endian int64, times this, hold the 8 bits (first
# byte lowest) in the top byte: the cross terms fall off either end.
_GATHER_BITS = 0x0102040810204080


def pack_bits(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack a flat bool tensor whose length is a multiple of 8 into uint8, LSB first.

    Args:
        bits: 1-D bool tensor, ``len(bits) % 8 == 0``.
        out: Optional uint8 tensor of ``len(bits) // 8`` bytes to write into.

    Returns:
        uint8 tensor of ``len(bits) // 8`` bytes.

    Raises:
        ValueError: If the length is not a multiple of 8.
    """
    if bits.numel() % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 bits, got {bits.numel()}")
    if bits.device.type == "cpu":
        packed = torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    else:
        packed = _gathered(bits)
    if out is None:
        return packed.to(torch.uint8)
    return out.copy_(packed)


def unpack_bits(packed: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 bytes to a flat bool tensor (8 per byte), the
    first ``count`` of them (default: all)."""
    count = packed.numel() * 8 if count is None else count
    if packed.device.type == "cpu":
        return torch.from_numpy(
            np.unpackbits(packed.numpy(), count=count, bitorder="little")).view(torch.bool)
    return _looked_up(packed)[:count]


def _gathered(bits: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bits` by tensor arithmetic (int64 bytes, any device)."""
    words = bits.contiguous().view(torch.uint8).view(torch.int64)
    return (words * _GATHER_BITS).bitwise_right_shift_(56).bitwise_and_(0xFF)


def _looked_up(packed: torch.Tensor) -> torch.Tensor:
    """:func:`unpack_bits` (all of them) by the table (any device)."""
    return bit_table(packed.device)[packed.long()].reshape(-1)


@functools.lru_cache(maxsize=None)
def bit_table(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` bool on ``device``: row ``b`` holds the 8 bits of byte ``b``, LSB first
    (built once per device, on it)."""
    byte = torch.arange(256, device=device)[:, None]
    return ((byte >> torch.arange(8, device=device)) & 1).bool()
