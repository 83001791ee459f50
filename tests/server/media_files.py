"""Media files for the server tests, made here: blank PNGs of any size without holding their pixels
(zlib fed one repeated row block at a time), e.g. a 20000x20000 PNG of a few hundred kB."""

from __future__ import annotations

import functools
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


@functools.lru_cache(maxsize=8)
def blank_png(width: int, height: int, channels: int = 3) -> bytes:
    """A valid black PNG (8-bit gray for channels=1, RGB for 3), compressed at level 9."""
    color = {1: 0, 3: 2}[channels]
    row = bytes(1 + width * channels)  # filter byte 0, then zeros
    rows_per_block = max(1, (1 << 22) // len(row))
    comp = zlib.compressobj(9)
    parts = []
    left = height
    while left:
        n = min(left, rows_per_block)
        parts.append(comp.compress(row * n))
        left -= n
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")
