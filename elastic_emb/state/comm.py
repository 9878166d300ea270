"""The communicator state transfer runs on: one world's process group for tensors, its store for
small JSON.

Every restore, commit and reshard of one generation talks through a :class:`Comm`. Tensors go
over the context's own ``process_group`` (a c10d ProcessGroup; raw methods are used, so it need
not be registered with ``torch.distributed``); a context without one gets a gloo group of its
own on a private store prefix. Small metadata (inventories, offers, verdicts) travels through
the store as JSON, never pickle, and every wait on it is bounded by the communicator's timeout.

A communicator used from a background thread (``interruptible``) waits on the store by polling
in short sleeps, so that :meth:`Comm.abort` from another thread ends the wait at once: a thread
still blocked inside the store client when the process exits is torn down mid-call (seen: the
store's server, in rank 0's process, closing under it aborts the process).

The k-th communicator a rank makes in a generation pairs with the k-th on every other rank (same
program order) and gets store keys of its own: reused keys would hand one exchange the values of
an earlier one, and a process group formed twice on one prefix hangs.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from elastic_emb import config
from elastic_emb.errors import CommAborted
from elastic_emb.events import get_logger
from elastic_emb.topology import Topology

log = get_logger("elastic_emb.state")

# Interruptible waits: the first poll after this many seconds, doubling up to the last (the latency a
# wait adds at most once the keys are there, against store round trips while it waits).
POLL_FIRST, POLL_MAX = 0.0005, 0.01

TRANSPORTS = ("cma", "p2p", "alltoall")  # ELASTIC_EMB_TRANSPORT values (see elastic_emb.state.transport)


def thread_store(store):
    """A client of ``store`` of its own, for a communicator used from a background thread.

    A TCPStore client serves one request at a time: a thread blocked in ``wait()`` on a client it
    shares stalls every ``set()`` of the other threads, and two ranks whose threads each wait for
    a key the other rank's stalled thread would set never wake (seen: the durable thread and the
    training thread). ``Store.clone()`` (torch >= 2.8) gives a connection of its own; a store
    without it (a Python store) is shared as it is."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        log.debug("store_not_cloned", store=type(store).__name__, error=str(exc)[:200])
        return store


class Comm:
    """The collective operations state transfer needs, on one world's process group and store."""

    def __init__(self, topology: Topology, store, process_group=None, *, timeout: float = 300.0,
                 device: torch.device | str | None = None, purpose: str = "state",
                 interruptible: bool = False) -> None:
        import torch.distributed as dist

        from elastic_emb.store import generation_store

        self.topology = topology
        self.rank = topology.rank
        self.size = topology.world_size
        self.timeout = timeout
        gen_store = generation_store(store, topology, purpose)
        self.instance = int(gen_store.add(f"instances/rank{self.rank}", 1))
        self.store = dist.PrefixStore(f"c{self.instance}/", gen_store)
        self._own_pg = process_group is None
        if process_group is None:
            pg_store = dist.PrefixStore(f"c{self.instance}/pg/", gen_store)
            process_group = dist.ProcessGroupGloo(pg_store, self.rank, self.size, timedelta(seconds=timeout))
        self.pg = process_group
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if topology.backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        # How rows travel (elastic_emb.state.transport): "cma" (CPU, pull from same-host senders'
        # memory, gloo p2p for any peer that cannot be read), "p2p" (CPU, gloo send/recv) or
        # "alltoall" (one collective over a packed buffer: the only safe way for NCCL).
        self.transport = config.load(None, "transport").transport or ("cma" if self.device.type == "cpu" else "alltoall")
        if self.transport != "alltoall" and self.device.type != "cpu":
            raise ValueError(f"ELASTIC_EMB_TRANSPORT={self.transport!r}: use 'alltoall' (any device), or 'cma' or "
                             f"'p2p' on CPU only; unset it for the default ('cma' on CPU, 'alltoall' on CUDA)")
        self._op = 0
        self.interruptible = interruptible
        self._aborted = threading.Event()

    def exchange(self, name: str, obj: Any) -> list[Any]:
        """All-gather a JSON-able object through the store; returns one entry per rank."""
        self._op += 1
        if self.size == 1:  # nobody to hear from: no store round trips (the background writer exchanges per commit)
            return [json.loads(json.dumps(obj))]
        base = f"x{self._op}-{name}"
        self.store.set(f"{base}/{self.rank}", json.dumps(obj))
        keys = [f"{base}/{r}" for r in range(self.size)]
        try:
            if self.interruptible:
                self._poll(keys, name)
            else:
                self.store.wait(keys, timedelta(seconds=self.timeout))
        except CommAborted:
            raise
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise TimeoutError(
                f"state exchange {name!r} (generation {self.topology.generation}): ranks {missing} did "
                f"not publish within {self.timeout}s; they died or are stuck: restart the workers"
            ) from exc
        return [json.loads(v) for v in self.store.multi_get(keys)]

    def _poll(self, keys: list[str], name: str) -> None:
        """Wait for ``keys`` by polling (bounded by the timeout), ending early on :meth:`abort`."""
        deadline = time.monotonic() + self.timeout
        pause = POLL_FIRST
        while not self.store.check(keys):
            if self._aborted.wait(pause):
                raise CommAborted(f"state exchange {name!r} (generation {self.topology.generation}) abandoned: "
                                  f"the communicator was aborted (a peer died)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout}s for {len(keys)} keys")
            pause = min(2 * pause, POLL_MAX)

    def all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
        """Send ``send[d]`` (uint8) to rank d; return the byte buffers received from each rank."""
        in_splits = [int(t.numel()) for t in send]
        inp = torch.cat([t.to(self.device) for t in send]) if send else torch.empty(0, dtype=torch.uint8, device=self.device)
        return self.all_to_all_flat(inp, in_splits, recv_sizes)

    def all_to_all_flat(self, inp: torch.Tensor, in_splits: list[int], recv_sizes: list[int],
                        out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One ``alltoall_base`` of a flat uint8 buffer (into ``out`` if given); every rank must
        call it, even with nothing to move."""
        import torch.distributed as dist

        if out is None:
            out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.device)
        elif out.numel() != sum(recv_sizes):
            raise ValueError(f"all_to_all_flat: out has {out.numel()} bytes, expected {sum(recv_sizes)}")
        opts = dist.AllToAllOptions()
        opts.timeout = timedelta(seconds=self.timeout)
        work = self.pg.alltoall_base(out, inp, list(recv_sizes), list(in_splits), opts)
        if not work.wait():
            raise RuntimeError(f"all_to_all of {sum(in_splits)} bytes failed on rank {self.rank}")
        return list(torch.split(out, list(recv_sizes)))

    def barrier(self, name: str) -> None:
        self.exchange(name, 0)

    def abort(self) -> None:
        """A peer died: an interruptible wait on the store (in another thread) raises
        :class:`CommAborted` now instead of at its timeout, and so does every later one. (A gloo
        transfer blocked on the peer is not ended by aborting its group: it runs to its timeout,
        or fails when the peer's connection closes.)"""
        self._aborted.set()

    def close(self) -> None:
        if self._own_pg:
            try:
                if hasattr(self.pg, "shutdown"):
                    self.pg.shutdown()
            except Exception as exc:  # teardown of a broken world: report, do not mask the caller's error
                log.warning("state_comm_close_failed", error=repr(exc))
