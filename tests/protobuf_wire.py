"""Protobuf's wire encoding written by hand (varints, field keys), for Chakra traces built
byte by byte in tests, independent of scaleout's schema code."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """``value`` as a base-128 varint."""
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def field(number: int, wire: int, payload: bytes) -> bytes:
    """Field ``number`` of wire type ``wire`` (0 varint, 2 length-delimited) and its payload."""
    return varint(number << 3 | wire) + payload
