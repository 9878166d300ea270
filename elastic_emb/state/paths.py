"""Where the state tiers put files: node identity and the directory layout under each root.

Snapshots live under ``<state_dir>/<run_id>/<node_id>/`` and durable checkpoints under
``<durable_dir>/<run_id>/``. The node id must be stable across restarts (torchrun renumbers node
ranks), so it is ``ELASTIC_EMB_NODE_ID`` if set, else the host name.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def node_id_from_env(env: Mapping[str, str] | None = None) -> str:
    """This node's stable identity: ELASTIC_EMB_NODE_ID, else the host name."""
    env = os.environ if env is None else env
    nid = env.get("ELASTIC_EMB_NODE_ID") or socket.gethostname()
    if not nid or "/" in nid or nid in (".", ".."):
        raise ValueError(f"node id {nid!r} (ELASTIC_EMB_NODE_ID or hostname) must be a plain name without '/'")
    return nid
