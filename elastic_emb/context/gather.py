"""Row gather from two sources in one pass: the last step of a sharded lookup.

A lookup's result row i is either a row this rank owns (in its table shard) or a row a peer
sent (in the receive buffer). Gathering the owned rows into the receive buffer first and then
reordering that buffer into the caller's order moves every owned row twice, and gathers
compete with the row exchange for memory bandwidth. :func:`gather_rows` reads each result row
straight from where it lives:

    pos[i] >= 0:  out[i] = received[pos[i]]
    pos[i] <  0:  out[i] = table[len(table) + pos[i]]    (from the end, as Python indexes)

On CUDA this is one Triton kernel (a block of rows per program, one masked load from each
source, one store). Elsewhere, or where Triton is missing or fails to compile, the same result
comes from torch ops (two gathers and a masked copy): slower, identical. The first failure is
logged once and the torch path is used from then on.
"""

from __future__ import annotations

import torch

from elastic_emb.events import get_logger

log = get_logger("elastic_emb.context.gather")

try:  # Triton ships with the CUDA builds of torch on Linux; CPU builds lack it.
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001  (any import problem means: use the torch path)
    triton = None

_kernel_failed: str | None = None

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(out_ptr, table_ptr, recv_ptr, pos_ptr, n, dim, table_rows, table_stride, recv_stride,
                            out_stride, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # 64-bit offsets: n x dim may pass 2**31
        in_range = rows < n
        pos = tl.load(pos_ptr + rows, mask=in_range, other=0)
        received = pos >= 0
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        from_recv = (in_range & received)[:, None] & col_ok[None, :]
        from_table = (in_range & ~received)[:, None] & col_ok[None, :]
        r = tl.where(received, pos, 0)
        t = tl.where(received, 0, pos + table_rows)
        a = tl.load(recv_ptr + r[:, None] * recv_stride + cols[None, :], mask=from_recv, other=0)
        b = tl.load(table_ptr + t[:, None] * table_stride + cols[None, :], mask=from_table, other=0)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], tl.where(received[:, None], a, b),
                 mask=in_range[:, None] & col_ok[None, :])


def _usable(out: torch.Tensor, table: torch.Tensor, received: torch.Tensor) -> bool:
    return (triton is not None and _kernel_failed is None and out.is_cuda
            and all(t.dim() == 2 and t.stride(1) == 1 and t.dtype == out.dtype for t in (out, table, received)))


def gather_rows(out: torch.Tensor, table: torch.Tensor, received: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` ``[len(pos), dim]`` from ``received`` (``pos >= 0``) and ``table``
    (``pos < 0``: row ``len(table) + pos``); returns ``out``. ``pos`` is int64 on ``out``'s device.
    Indices are trusted (the lookup computed them); the torch path checks them, the kernel
    does not."""
    global _kernel_failed
    n = pos.numel()
    if n == 0:
        return out
    if _usable(out, table, received):
        dim = out.shape[1]
        block_d = triton.next_power_of_2(dim)
        rows = max(1, min(64, 4096 // block_d))  # about 4K elements per program
        try:
            _gather_rows_kernel[(triton.cdiv(n, rows),)](
                out, table, received if received.numel() else out, pos, n, dim, table.shape[0], table.stride(0),
                received.stride(0), out.stride(0), ROWS=rows, BLOCK_D=block_d, num_warps=4)
            return out
        except Exception as exc:  # noqa: BLE001  (compile or launch failure: fall back, once, loudly)
            _kernel_failed = repr(exc)[:300]
            log.warning("gather.kernel_unavailable", error=_kernel_failed)
    received_at = pos >= 0
    if received.numel():
        torch.index_select(received, 0, pos.clamp(min=0), out=out)
    owned = (~received_at).nonzero().squeeze(1)
    if owned.numel():
        out.index_copy_(0, owned, table.index_select(0, pos.index_select(0, owned) + table.shape[0]))
    return out


def kernel_status() -> str:
    """'triton', 'torch (no triton)' or 'torch (kernel failed: ...)', for logs and benchmarks."""
    if triton is None:
        return "torch (no triton)"
    return "triton" if _kernel_failed is None else f"torch (kernel failed: {_kernel_failed})"
