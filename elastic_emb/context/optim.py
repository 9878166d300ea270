"""Sparse row-wise optimizers applied by the owner of the rows.

The owner calls :func:`apply_rows` with *unique* local rows and each row's summed gradient:
``sgd`` (``w[i] -= lr * g[i]``) or row-wise ``adagrad`` (one float32 accumulator per row:
``acc[i] += mean(g[i] ** 2)``; ``w[i] -= lr * g[i] / (sqrt(acc[i]) + eps)``).
:func:`slot_shapes` and :func:`init_slots` describe and fill the slots;
:func:`dense_reference_step` is the single-process reference the tests compare with.

Design: ``docs/CONTEXT.md`` (section "Optimizers").
"""

from __future__ import annotations

import torch

from elastic_emb.protocol import OptimizerSpec


def slot_shapes(spec: OptimizerSpec, dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-row shape (after the row dimension) and dtype of each optimizer slot.

    Args:
        spec: the optimizer.
        dim: the table's width.

    Returns:
        ``{slot name: (shape, dtype)}``; empty for SGD.
    """
    if spec.kind == "adagrad":
        return {"accumulator": ((), torch.float32)}
    return {}


def init_slots(spec: OptimizerSpec, slots: dict[str, torch.Tensor]) -> None:
    """Fill freshly allocated slots with their initial values.

    Args:
        spec: the optimizer.
        slots: the slots by name, written in place.
    """
    if spec.kind == "adagrad":
        slots["accumulator"].fill_(spec.initial_accumulator)


def apply_rows(
    spec: OptimizerSpec,
    weight: torch.Tensor,
    slots: dict[str, torch.Tensor],
    index: torch.Tensor,
    grad: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> dict[str, torch.Tensor] | None:
    """Update ``weight[index]`` (and its slots) in place with the summed gradients ``grad``.

    Args:
        spec: the optimizer.
        weight: the table's local rows.
        slots: the table's slots by name.
        index: unique local row indices (the caller deduplicates and sums).
        grad: ``[len(index), dim]`` summed gradients.
        keep: optional bool ``[len(index)]``: rows where it is False are left exactly as they
            were (their gradient may be NaN); decided on the device, no sync.

    Returns:
        The values now in the rows ``index``, per tensor (``"weight"`` and each slot by name,
        ``[len(index), ...]``), where the update computed them whole (Adagrad); None where it
        did not (SGD adds in place) or ``index`` is empty. A GPU commit copies them as the delta
        instead of gathering the rows again (:mod:`elastic_emb.state.capture`).

    Raises:
        ValueError: for an optimizer kind other than ``sgd`` or ``adagrad``.
    """
    if index.numel() == 0:
        return None
    if spec.kind == "sgd":
        g = grad.to(weight.dtype)
        if keep is not None:
            g = torch.where(keep.unsqueeze(1), g, 0)  # w + (-lr * 0) == w exactly
        weight.index_add_(0, index, g, alpha=-spec.lr)
        return None
    if spec.kind == "adagrad":
        acc = slots["accumulator"]
        g32 = grad.to(torch.float32)
        if keep is not None:
            g32 = torch.where(keep.unsqueeze(1), g32, 0)
        old_acc = acc.index_select(0, index)
        new_acc = old_acc + g32.pow(2).mean(dim=1)
        if keep is not None:
            new_acc = torch.where(keep, new_acc, old_acc)
        acc.index_copy_(0, index, new_acc)
        step = g32 / (new_acc.sqrt() + spec.eps).unsqueeze(1)
        old_rows = weight.index_select(0, index)
        rows = (old_rows.to(torch.float32) - spec.lr * step).to(weight.dtype)
        if keep is not None:
            rows = torch.where(keep.unsqueeze(1), rows, old_rows)
        weight.index_copy_(0, index, rows)
        return {"weight": rows, "accumulator": new_acc}
    raise ValueError(f"optimizer kind={spec.kind!r} is not supported; use 'sgd' or 'adagrad'")


def dense_reference_step(
    spec: OptimizerSpec,
    weight: torch.Tensor,
    slots: dict[str, torch.Tensor],
    ids: torch.Tensor,
    grads: torch.Tensor,
) -> None:
    """The same update on a whole (unsharded) table given raw ids with duplicates.

    Used as the single-process reference; sums duplicate gradients first, like
    ``torch.nn.Embedding(sparse=True)`` followed by ``coalesce()``.

    Args:
        spec: the optimizer.
        weight: the whole table, updated in place.
        slots: its slots by name.
        ids: global row ids, duplicates allowed.
        grads: ``[len(ids), dim]`` gradients.
    """
    if ids.numel() == 0:
        return
    uniq, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(uniq.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
    summed.index_add_(0, inverse, grads)
    apply_rows(spec, weight, slots, uniq, summed)
