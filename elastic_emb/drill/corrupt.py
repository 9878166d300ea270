"""Plant a silent loss in a node's newest snapshot, to prove the drill's verification catches it.

:func:`corrupt_newest_snapshot` changes rows of a node's newest own snapshot and rewrites the
manifest's CRC32s to match, so the restore trusts them and only the replay can tell.

Design: ``docs/DRILLS.md`` (section "Planting a loss").
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from elastic_emb.state import SnapshotManifest, write_atomic


def corrupt_newest_snapshot(state_dir: Path, *, table: str = "user", rows: int = 3, delta: float = 0.5) -> dict:
    """Add ``delta`` to the first rows of ``table`` in every own shard of the newest commit, fixing the CRC32s.

    Replica shards (``*.replica.json``) are left alone. In a delta commit the rows changed are the
    first ``rows`` rows the commit holds.

    Args:
        state_dir: a node's state directory (``ELASTIC_EMB_STATE_DIR``).
        table: the table whose rows are changed.
        rows: how many rows of each shard to change (fewer if the shard holds fewer).
        delta: what is added to each value of those rows.

    Returns:
        ``{"corrupted": [...]}``: per shard changed, the table, the global rows, the step, the
        data file and the delta (for the drill's report).

    Raises:
        FileNotFoundError: if ``state_dir`` holds no snapshot manifest.
        ValueError: if the newest commit holds no rows of ``table``.
    """
    manifests = sorted(state_dir.glob("*/*/step-*/rank*.json"))
    own = []
    for path in manifests:
        if path.name.endswith(".replica.json"):
            continue
        m = SnapshotManifest.model_validate_json(path.read_text())
        own.append((m.step, path, m))
    if not own:
        raise FileNotFoundError(f"no snapshot manifest under {state_dir}: nothing to corrupt (did the node commit?)")
    newest = max(step for step, _, _ in own)
    changed = []
    for step, mpath, m in own:
        if step != newest:
            continue
        data = mpath.parent / m.data_file
        blob = bytearray(data.read_bytes())
        shards = []
        for rec in m.shards:
            tensors = []
            # A delta commit holds only the changed rows, their local numbers in its "index" tensor.
            index = next((tr for tr in rec.tensors if tr.name == "index"), None)
            for tr in rec.tensors:
                if rec.table == table and tr.name == "weight" and tr.nbytes:
                    w = torch.frombuffer(blob, dtype=getattr(torch, tr.dtype), count=tr.nbytes // 4, offset=tr.offset)
                    w = w.view(-1, *tr.row_shape)
                    n = min(rows, w.shape[0])
                    w[:n] += delta  # writes through into `blob`
                    tr = tr.model_copy(update={"crc32": zlib.crc32(bytes(blob[tr.offset : tr.offset + tr.nbytes]))})
                    if index is None:
                        hit = list(range(rec.start, rec.start + n))
                    else:
                        local = torch.frombuffer(blob, dtype=torch.int64, count=index.nbytes // 8, offset=index.offset)
                        hit = [rec.start + int(r) for r in local[:n]]
                    changed.append(
                        {
                            "table": table,
                            "rows": [min(hit), max(hit) + 1],
                            "row_list": hit,
                            "step": step,
                            "file": str(data),
                            "delta": delta,
                        }
                    )
                tensors.append(tr)
            shards.append(rec.model_copy(update={"tensors": tensors}))
        data.write_bytes(bytes(blob))
        write_atomic(mpath, m.model_copy(update={"shards": shards}).model_dump_json())
    if not changed:
        raise ValueError(f"the newest commit (step {newest}) under {state_dir} holds no rows of table {table!r}")
    return {"corrupted": changed}
