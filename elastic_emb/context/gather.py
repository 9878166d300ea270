"""Row gather from two sources in one pass: the last step of a sharded lookup.

- :func:`gather_rows`: each result row read straight from the receive buffer (``pos >= 0``) or
  from this rank's shard (``pos < 0``, counted from its end);
- :func:`gather_ids`: the one-source form for a world of one rank, with the range check counted
  in a device record instead of a host sync;
- :func:`kernel_status`: which path runs. On CUDA both are Triton kernels; elsewhere, or where
  Triton fails, torch ops give the same result (the first failure is logged once).

Design: ``docs/CONTEXT.md`` (section "Row gather").
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
try:  # Triton 3's launch hooks (direct launches pass them on, as Triton's own launch does)
    from triton import knobs as _knobs
except Exception:  # noqa: BLE001
    _knobs = None

_kernel_failed: str | None = None
# gather_ids: compiled kernels by the specialization Triton would pick for the arguments, launched
# directly (Triton's per-call argument binding costs more host time than the rest of a lookup).
_compiled: dict[tuple, object] = {}
_direct_failed: str | None = None
_direct_launches = 0

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(
        out_ptr,
        table_ptr,
        recv_ptr,
        pos_ptr,
        n,
        dim,
        table_rows,
        table_stride,
        recv_stride,
        out_stride,
        ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
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
        tl.store(
            out_ptr + rows[:, None] * out_stride + cols[None, :],
            tl.where(received[:, None], a, b),
            mask=in_range[:, None] & col_ok[None, :],
        )

    @triton.jit
    def _gather_ids_kernel(
        out_ptr,
        table_ptr,
        ids_ptr,
        rec_ptr,
        n,
        dim,
        table_rows,
        table_stride,
        out_stride,
        ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        in_range = rows < n
        ids = tl.load(ids_ptr + rows, mask=in_range, other=0)
        bad = in_range & ((ids < 0) | (ids >= table_rows))
        safe = tl.where(bad, 0, ids)
        cols = tl.arange(0, BLOCK_D)
        ok = in_range[:, None] & (cols < dim)[None, :]
        vals = tl.load(table_ptr + safe[:, None] * table_stride + cols[None, :], mask=ok, other=0)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], vals, mask=ok)
        nbad = tl.sum(bad.to(tl.int64), axis=0)
        if nbad > 0:  # rare: only blocks with bad ids touch the record
            tl.atomic_add(rec_ptr, nbad)
            tl.atomic_max(rec_ptr + 1, tl.max(tl.where(bad, n - rows, 0), axis=0))


def _usable(out: torch.Tensor, table: torch.Tensor, received: torch.Tensor) -> bool:
    return (
        triton is not None
        and _kernel_failed is None
        and out.is_cuda
        and all(t.dim() == 2 and t.stride(1) == 1 and t.dtype == out.dtype for t in (out, table, received))
    )


def gather_rows(out: torch.Tensor, table: torch.Tensor, received: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` from ``received`` (``pos >= 0``) and ``table`` (``pos < 0``: row
    ``len(table) + pos``). Indices are trusted (the lookup computed them); the torch path checks
    them, the kernel does not.

    Args:
        out: ``[len(pos), dim]``, written.
        table: this rank's shard.
        received: the receive buffer.
        pos: int64 on ``out``'s device, one source per result row.

    Returns:
        ``out``.
    """
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
                out,
                table,
                received if received.numel() else out,
                pos,
                n,
                dim,
                table.shape[0],
                table.stride(0),
                received.stride(0),
                out.stride(0),
                ROWS=rows,
                BLOCK_D=block_d,
                num_warps=4,
            )
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


def _block(dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(dim)
    return max(1, min(64, 4096 // block_d)), block_d  # about 4K elements per program


def _specialization(args: tuple) -> tuple:
    """What Triton specializes a launch on (Triton 3: pointer alignment to 16 bytes; integers'
    divisibility by 16, equality to 1 and width), plus the dtypes, constexprs and device."""
    key = [args[0].device.index, args[0].dtype, args[2].dtype, args[9], args[10]]
    for a in args[:4]:
        key.append(a.data_ptr() % 16 == 0)
    for v in args[4:9]:
        key.append((v % 16 == 0, v == 1, -(2**31) <= v < 2**31))
    return tuple(key)


def _args(out, table, ids, record) -> tuple:
    rows, block_d = _block(out.shape[1])
    return (
        out,
        table,
        ids,
        record,
        ids.numel(),
        out.shape[1],
        table.shape[0],
        table.stride(0),
        out.stride(0),
        rows,
        block_d,
    )


def _launch_direct(args: tuple, stream=None) -> bool:
    """Launch an already compiled gather_ids kernel without Triton's argument binding; False
    when there is none for these arguments (or direct launches are not possible here)."""
    global _direct_failed, _direct_launches
    if _direct_failed is not None or _knobs is None or not args[4] or not _usable(args[0], args[1], args[0]):
        return False
    kernel = _compiled.get(_specialization(args))
    if kernel is None:
        return False
    try:
        handle = (stream if stream is not None else torch.cuda.current_stream(args[0].device)).cuda_stream
        grid = (triton.cdiv(args[4], args[9]), 1, 1)
        hooks = _knobs.runtime
        meta = kernel.launch_metadata(grid, handle, *args)  # None unless a launch hook is set
        kernel.run(
            *grid,
            handle,
            kernel.function,
            kernel.packed_metadata,
            meta,
            hooks.launch_enter_hook,
            hooks.launch_exit_hook,
            *args,
        )
        _direct_launches += 1
        return True
    except Exception as exc:  # noqa: BLE001  (another Triton's launcher: use Triton's own launch from now on)
        _direct_failed = repr(exc)[:300]
        log.warning("gather.direct_launch_unavailable", error=_direct_failed)
        return False


def gather_ids(
    out: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    record: torch.Tensor,
    stream: "torch.cuda.Stream | None" = None,
) -> torch.Tensor:
    """``out[i] = table[ids[i]]`` for ``ids`` in ``[0, len(table))``; an id outside reads row 0
    instead and is counted in ``record``. No host synchronisation.

    Args:
        out: ``[len(ids), dim]``, written.
        table: the shard, at least one row.
        ids: int64 on ``out``'s device.
        record: int64 on the device: ``record[0] +=`` the count of bad ids,
            ``record[1] = max(record[1], len(ids) - position of the first bad id)``.
        stream: the stream to run on (default: the current one).

    Returns:
        ``out``.
    """
    global _kernel_failed
    n = ids.numel()
    if n == 0:
        return out
    if stream is not None:
        if triton is not None and _launch_direct(_args(out, table, ids, record), stream):
            return out
        with torch.cuda.stream(stream):
            return gather_ids(out, table, ids, record)
    if _usable(out, table, out):
        args = _args(out, table, ids, record)
        rows, block_d = args[9], args[10]
        try:
            if not _launch_direct(args):
                key = _specialization(args)
                _compiled[key] = _gather_ids_kernel[(triton.cdiv(n, rows),)](
                    *args[:9], ROWS=rows, BLOCK_D=block_d, num_warps=4
                )
            return out
        except Exception as exc:  # noqa: BLE001  (compile or launch failure: fall back, once, loudly)
            _kernel_failed = repr(exc)[:300]
            log.warning("gather.kernel_unavailable", error=_kernel_failed)
    bad = (ids < 0) | (ids >= table.shape[0])
    torch.index_select(table, 0, torch.where(bad, 0, ids), out=out)
    record[0] += bad.sum()
    first = torch.where(bad, n - torch.arange(n, device=ids.device), 0).max()
    torch.maximum(record[1], first, out=record[1])
    return out


def kernel_status() -> str:
    """Which gather path runs, for logs and benchmarks.

    Returns:
        ``'triton'`` (with how kernels are launched), ``'torch (no triton)'`` or
        ``'torch (kernel failed: ...)'``.
    """
    if triton is None:
        return "torch (no triton)"
    if _kernel_failed is not None:
        return f"torch (kernel failed: {_kernel_failed})"
    return "triton" + (
        f" (direct launch failed: {_direct_failed})"
        if _direct_failed
        else " (direct launch)"
        if _direct_launches
        else ""
    )
