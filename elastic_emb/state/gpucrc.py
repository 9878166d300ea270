"""CRC32 (zlib's) of byte ranges of a tensor computed with tensor operations, on the GPU.

A delta captured on the GPU is checksummed where its bytes already are, so the host only copies
them into the log. CRC32 is linear over GF(2): reading a 32-bit little-endian word ``w`` into the
register ``s`` gives ``A(s ^ w)``, where ``A`` advances the register over 32 zero bits (a 32x32
bit matrix). Over words ``w_0 .. w_{L-1}`` from the initial register ``s0``:

    raw = A^L s0  ^  A · XOR_i A^(L-1-i) w_i        crc32 = ~raw (32 bits)

The XOR sum is computed by blocks of ``B`` words: within a block, word ``j`` is multiplied by
``M^(B-1-j)`` (``M = A`` at the first level) through four 256-entry tables per position (one per
byte of the word, the product being linear: ``M(x) = T0[x & 255] ^ T1[x >> 8 & 255] ^ ...``),
gathered and xor-reduced (a halving tree); each block's result is one word of the next level,
whose matrix is ``M^B``. Zeros put in front of a level change nothing. Five levels of ``B = 256``
cover 2**40 words. The tables (1 MiB per level) are built once per device with numpy. A range
whose length is not a multiple of four leaves up to 3 bytes for the caller (:func:`finish`).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from elastic_emb.state.crc import _ZEROS, _times, crc32_combine

B = 256  # words per block at every level
LEVELS = 5
_tables: dict[str, torch.Tensor] = {}


def _matrix_power(mat: list[int], e: int) -> list[int]:
    """``mat ** e`` (columns as ints), by squaring."""
    out = [1 << i for i in range(32)]
    sq = mat
    while e:
        if e & 1:
            out = [_times(sq, c) for c in out]
        sq = [_times(sq, c) for c in sq]
        e >>= 1
    return out


def _level_table(m: list[int]) -> np.ndarray:
    """int32 [B, 4, 256]: entry [j, lane, x] = M^(B-1-j) (x << 8*lane)."""
    cols = np.zeros((B, 32), dtype=np.uint64)
    p = [1 << i for i in range(32)]  # M^0
    for j in range(B - 1, -1, -1):
        cols[j] = p
        p = [_times(m, c) for c in p]  # M^(B-j)
    x = np.arange(256, dtype=np.uint64)
    out = np.zeros((B, 4, 256), dtype=np.uint64)
    for lane in range(4):
        for bit in range(8):
            on = ((x >> np.uint64(bit)) & np.uint64(1)).astype(bool)
            out[:, lane, on] ^= cols[:, lane * 8 + bit][:, None]
    return out.astype(np.uint32).view(np.int32)


def tables(device: torch.device) -> torch.Tensor:
    """int32 [LEVELS, B*4*256] on ``device``: level k uses M = A^(B^k)."""
    key = str(device)
    if key not in _tables:
        a = _ZEROS[2]  # 4 zero bytes: A
        levels, m = [], a
        for _ in range(LEVELS):
            levels.append(_level_table(m).reshape(-1))
            m = _matrix_power(m, B)
        _tables[key] = torch.from_numpy(np.stack(levels)).to(device)
    return _tables[key]


def _xor_sum(words: torch.Tensor, tab: torch.Tensor) -> torch.Tensor:
    """XOR_i M^(L-1-i) w_i of int32 ``words`` (1-D), ``tab`` the tables of all levels."""
    level = 0
    v = words
    while True:
        n = v.numel()
        if n == 0:
            return torch.zeros((), dtype=torch.int32, device=v.device)
        nb = -(-n // B)
        if nb * B != n:
            v = torch.cat([torch.zeros(nb * B - n, dtype=torch.int32, device=v.device), v])
        v = v.view(nb, B)
        t = tab[level]
        pos = torch.arange(B, device=v.device, dtype=torch.int32) * 1024
        acc = None
        for lane in range(4):
            idx = ((v >> (8 * lane)) & 255).add_(pos + lane * 256)  # int32 indices: half the traffic
            part = torch.index_select(t, 0, idx.view(-1)).view(nb, B)
            acc = part if acc is None else acc.bitwise_xor_(part)
        width = B
        while width > 1:
            width //= 2
            acc = acc[:, :width] ^ acc[:, width: 2 * width]
        v = acc.reshape(-1)
        if nb == 1:
            return v[0]
        level += 1
        if level >= LEVELS:
            raise ValueError(f"{words.numel()} words exceed what {LEVELS} levels of {B} cover")


def checksum_words(buf: torch.Tensor, ranges: list[tuple[int, int]],
                   chunk_words: int = 1 << 25) -> tuple[torch.Tensor, list[list[int]]]:
    """The XOR sums of the 4-aligned prefix of each ``(offset, nbytes)`` range of the uint8
    ``buf`` (offsets multiples of 4), chunk by chunk (``chunk_words``: bounded temporary memory),
    as one int32 tensor on ``buf``'s device; no host sync. Also returns, per range, the words
    after each of its chunks (host-known), which :func:`finish` needs to join them."""
    tab = tables(buf.device)
    sums, after = [], []
    for off, n in ranges:
        if off % 4:
            raise ValueError(f"range offset {off} is not a multiple of 4")
        words = buf[off: off + n - n % 4].view(torch.int32)
        rest = []
        for c in range(0, words.numel(), chunk_words):
            sums.append(_xor_sum(words[c: c + chunk_words], tab))
            rest.append(words.numel() - min(c + chunk_words, words.numel()))
        after.append(rest)
    out = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int32, device=buf.device)
    return out, after


def finish(chunk_sums: list[int], after: list[int], nbytes: int, tail: bytes) -> int:
    """The CRC32 of a range (``nbytes`` long, ``tail`` its last ``nbytes % 4`` bytes) from its
    chunks' XOR sums and the words after each (:func:`checksum_words`)."""
    words = nbytes // 4
    s = 0
    for x, rest in zip(chunk_sums, after):
        s ^= _advance_host(x & 0xFFFFFFFF, 4 * rest)
    raw = _times(_ZEROS[2], s) if words else 0  # A · XOR-sum
    raw ^= _advance_host(0xFFFFFFFF, 4 * words)
    crc = ~raw & 0xFFFFFFFF
    return zlib.crc32(tail, crc) if tail else crc


def _advance_host(s: int, nbytes: int) -> int:
    """The register ``s`` advanced over ``nbytes`` zero bytes."""
    return crc32_combine(s, 0, nbytes)
