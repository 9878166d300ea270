"""Plant a silent loss in a node's newest snapshot, to prove the drill's verification catches it.

A snapshot damaged at random is caught by its CRC32 (:func:`elastic_emb.state.read_snapshot`)
and the restore falls back or fails: that is the state layer's own defence, tested there. The
drill has to catch what gets past every checksum: a state layer that writes *wrong rows with a
matching checksum* (a bug, not a disk error). So this module changes rows of the newest own
snapshot in a node directory and rewrites the manifest's CRC32 to match, with the state layer's
own manifest records. The restore then trusts the rows, training goes on, and only the
comparison with the reference replay can tell; the drill must fail naming the rows and the step.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from elastic_emb.state import SnapshotManifest, write_atomic


def corrupt_newest_snapshot(state_dir: Path, *, table: str = "user", rows: int = 3, delta: float = 0.5) -> dict:
    """Add ``delta`` to the first ``rows`` rows of ``table`` in every own shard of the newest commit
    under ``state_dir``; fix the CRC32s. Returns what was changed (for the drill's report)."""
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
                    tr = tr.model_copy(update={"crc32": zlib.crc32(bytes(blob[tr.offset: tr.offset + tr.nbytes]))})
                    if index is None:
                        hit = list(range(rec.start, rec.start + n))
                    else:
                        local = torch.frombuffer(blob, dtype=torch.int64, count=index.nbytes // 8, offset=index.offset)
                        hit = [rec.start + int(r) for r in local[:n]]
                    changed.append({"table": table, "rows": [min(hit), max(hit) + 1], "row_list": hit, "step": step,
                                    "file": str(data), "delta": delta})
                tensors.append(tr)
            shards.append(rec.model_copy(update={"tensors": tensors}))
        data.write_bytes(bytes(blob))
        write_atomic(mpath, m.model_copy(update={"shards": shards}).model_dump_json())
    if not changed:
        raise ValueError(f"the newest commit (step {newest}) under {state_dir} holds no rows of table {table!r}")
    return {"corrupted": changed}
