"""A thin Python wrapper that lets elastic_emb's lifecycle drive a native (C++) context.

``async_emb.cpp`` next to this file is a torch extension shaped like the seed's
``AsyncEmbContext``: a C++ object built for one world size that owns its rows and whose
``reset(rank, world_size)`` throws ``std::invalid_argument("async_emb world size changed from X
to Y")`` for any other size. :func:`build` compiles it with ``torch.utils.cpp_extension`` (g++ on
the CPU; the same source on a CUDA build of torch keeps its rows on the GPU), into a cache
directory, so a machine compiles it once and every later process only loads it.

:class:`NativeContext` implements elastic_emb's context contract around it:

* construction builds a new native object for the agreed topology, and a private gloo group (the
  "communicator" of this generation) that its training step synchronises over;
* ``reset`` forwards to the native ``reset``; its ``std::invalid_argument`` about the world size
  (pybind11 turns it into ``ValueError``) becomes :class:`elastic_emb.errors.WorldSizeChanged`
  carrying the native message first; any other native ``invalid_argument`` stays a ``ValueError``;
* ``export_shard`` copies the native rows out; ``shard_views`` hands out the native object's own
  tensors, so a restore writes rows straight into C++-owned memory; ``import_shard`` copies in;
* ``close`` drops the group and releases the native object (its rows are freed at once).

The lifecycle never calls ``reset`` across sizes; it closes this context and constructs a new one.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_emb import (
    ContextBase,
    ContextClosed,
    RowRange,
    ShardData,
    TableSpec,
    Topology,
    WorldSizeChanged,
    generation_store,
)

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "async_emb.cpp"
SEED_MESSAGE = re.compile(r"^async_emb world size changed from (\d+) to (\d+)$")

_module = None


def cache_dir() -> Path:
    """Where the compiled extension lives: ``$ELASTIC_EMB_NATIVE_CACHE``, else
    ``~/.cache/elastic_emb/native_context``; one sub-directory per torch version, device kind and
    source hash, so an edit or another torch rebuilds and nothing stale is loaded."""
    from elastic_emb import load_settings

    root = load_settings(None, "native_cache").native_cache or os.path.join(
        os.path.expanduser("~"), ".cache", "elastic_emb", "native_context"
    )
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return Path(root) / f"torch{torch.__version__.replace('+', '_')}-{kind}-{digest}"


BUILD_TIMEOUT_S = 600.0  # a compile takes well under a minute; another one's lock is waited for this long


def build(verbose: bool = False):
    """Compile (first time on this machine) or load (every later time) the extension module.

    Args:
        verbose: show the compiler's output.

    Returns:
        The loaded extension module.

    Raises:
        TimeoutError: another process held the build lock for longer than ``BUILD_TIMEOUT_S``.
    """
    global _module
    if _module is None:
        import fcntl

        from torch.utils import cpp_extension

        where = cache_dir()
        where.mkdir(parents=True, exist_ok=True)
        # Processes starting at once wait for one compile instead of racing. The kernel's lock,
        # not torch's lock file: a compile killed midway leaves torch's file behind, and every later
        # load would wait on it forever; a flock ends with its process. Holding it, any torch lock
        # file left in the directory is stale.
        with open(where / "build.flock", "w") as guard:
            deadline = time.monotonic() + BUILD_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"another process has compiled in {where} for over {BUILD_TIMEOUT_S:.0f} s; "
                            f"stop it, or remove {where} and retry"
                        ) from None
                    time.sleep(0.2)
            (where / "lock").unlink(missing_ok=True)
            _module = cpp_extension.load(
                name="elastic_emb_async_emb",
                sources=[str(SOURCE)],
                build_directory=str(where),
                extra_cflags=["-O1"],
                verbose=verbose,
            )
    return _module


class NativeWorldSizeChanged(WorldSizeChanged):
    """WorldSizeChanged raised by the native context: its message starts with the native one."""

    def __init__(self, native_message: str, old: int, new: int) -> None:
        super().__init__(old, new)
        self.native_message = native_message
        self.args = (f"{native_message} (native AsyncEmbContext.reset); {self.args[0]}",)


def translate(exc: ValueError) -> Exception:
    """Map the native ``std::invalid_argument`` about the world size to WorldSizeChanged."""
    m = SEED_MESSAGE.match(str(exc))
    if m is None:
        return exc
    return NativeWorldSizeChanged(str(exc), int(m.group(1)), int(m.group(2)))


class NativeContext(ContextBase):
    """elastic_emb's context contract around the native ``AsyncEmbContext`` (module docstring).

    No change tracking (``tracks_changes`` False: the lifecycle takes full snapshots)."""

    def __init__(self, topology: Topology, store, *, tables: list[TableSpec], timeout: float = 60.0) -> None:
        for t in tables:
            if t.dtype != "float32":
                raise ValueError(
                    f"table {t.name!r}: dtype {t.dtype} is not supported by the native context; use float32"
                )
        ext = build()
        self.topology = topology
        self.tables = {t.name: t for t in tables}
        self.timeout = timeout
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self._store = store
        self._forms = 0
        self._closed = False
        self._healthy = True
        # Rows start at zero (the native object's choice); on a first start, the caller fills them.
        self._native = ext.AsyncEmbContext(
            topology.rank,
            topology.world_size,
            topology.ep_size,
            [(t.name, t.num_rows, t.dim) for t in tables],
            str(self.device),
        )
        self.process_group = self._form(topology, store)

    def _form(self, topology: Topology, store):
        """The communicator of one generation: a gloo group on a store prefix private to it."""
        self._forms += 1
        prefix = dist.PrefixStore(f"native{self._forms}/", generation_store(store, topology, "native"))
        pg = dist.ProcessGroupGloo(prefix, topology.rank, topology.world_size, timedelta(seconds=self.timeout))
        return pg

    # -- the contract --------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    def reset(self, rank: int, world_size: int, *, topology: Topology, store) -> None:
        """Same world size only; another size raises WorldSizeChanged with the native message."""
        native = self._require()
        try:
            native.reset(rank, world_size)  # the native rule first: it decides about the world size
        except ValueError as exc:
            raise translate(exc) from exc
        if (topology.ep_size, topology.backend) != (self.topology.ep_size, self.topology.backend):
            raise ValueError(
                f"reset to ep_size={topology.ep_size} backend={topology.backend} from "
                f"ep_size={self.topology.ep_size} backend={self.topology.backend}: the native rows are laid "
                f"out for one EP size; close this context and construct a new one"
            )
        self.process_group = self._form(topology, store)
        self.topology, self._store, self._healthy = topology, store, True

    def close(self, *, abort: bool | None = None, wait: bool = True) -> None:
        """Release the group and the native object (synchronously; gloo needs no background
        destroy). Idempotent."""
        if not self._closed:
            self._closed = True
            pg, self.process_group = self.process_group, None
            if pg is not None and (abort or (abort is None and not self._healthy)):
                pg.abort()  # gloo: close this end's connections now; peers waiting on it fail fast
            native, self._native = self._native, None
            native.release()  # rows freed now, even while a traceback still holds the object

    def owned(self, table: str) -> RowRange:
        return RowRange(*self._require().owned(table))

    def shard_views(self) -> dict[str, ShardData]:
        native = self._require()
        return {
            n: ShardData(n, self.owned(n), native.weight(n), {"accumulator": native.accumulator(n)})
            for n in self.tables
        }

    def export_shard(self) -> dict[str, ShardData]:
        return {
            n: ShardData(n, s.rows, s.weight.clone(), {k: v.clone() for k, v in s.slots.items()})
            for n, s in self.shard_views().items()
        }

    def import_shard(self, shards) -> None:
        views = self.shard_views()
        if set(shards) != set(views):
            raise ValueError(f"import_shard got tables {sorted(shards)}; this context has {sorted(views)}")
        for name, s in shards.items():
            v = views[name]
            if s.rows != v.rows or tuple(s.weight.shape) != tuple(v.weight.shape) or set(s.slots) != {"accumulator"}:
                raise ValueError(
                    f"table {name!r}: shard rows [{s.rows.start}, {s.rows.stop}) of shape "
                    f"{tuple(s.weight.shape)} with slots {sorted(s.slots)} is not this rank's "
                    f"[{v.rows.start}, {v.rows.stop}) of shape {tuple(v.weight.shape)} with ['accumulator']"
                )
        for name, s in shards.items():
            v = views[name]
            v.weight.copy_(s.weight)
            v.slots["accumulator"].copy_(s.slots["accumulator"])

    # -- training (the example's stand-in for a real step) -------------------------------------

    def train_step(self, step: int) -> None:
        """The native step on this rank's rows, then an all-reduce so every rank steps together."""
        self._require().train_step(step)
        self.barrier()

    def barrier(self) -> None:
        """One collective over the communicator; a failure marks the context unhealthy."""
        self._require()
        t = torch.ones(1)
        try:
            self.process_group.allreduce([t]).wait(timedelta(seconds=self.timeout))
        except Exception:
            self._healthy = False
            raise
        if int(t.item()) != self.topology.world_size:
            self._healthy = False
            raise RuntimeError(f"{int(t.item())} of {self.topology.world_size} ranks took part in the all-reduce")

    def native_counters(self) -> dict[str, int]:
        """This process's native constructions, resets and releases so far."""
        return dict(build().counters())

    @property
    def native(self):
        return self._require()

    def _require(self):
        if self._closed or self._native is None:
            raise ContextClosed("the native context is closed: the lifecycle constructs a new one")
        return self._native
