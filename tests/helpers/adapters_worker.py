"""One rank of a real gloo world driving an adapter context through a Lifecycle.

Run as ``python -c "from tests.helpers import adapters_worker; adapters_worker.main()"`` with the rank's torchrun
environment plus ``ADW_SPEC`` (JSON):

* ``context``: ``native`` (examples/native_context) or ``torchrec`` (elastic_emb.adapters.torchrec
  over tests/helpers/torchrec_model.py);
* ``out``: directory for dumps; ``tables``: TableSpec fields;
* ``wait_file``: start only once this file exists (a joiner waits for the world it joins);
* ``phases``: the first is ``Lifecycle.start`` from this process's environment; each later one is
  an in-process membership change to ``env`` (torchrun variables), or ``{"depart": true}`` (the
  process leaves like a lost node: no clean-up); a change may name the ranks of the old world
  that are ``gone`` (given up on first, as the in-process resize does for departed nodes). Each
  phase trains up to step ``until`` (committing every step) and dumps this rank's shard as
  ``<dump>-r<rank>.pt`` (and after each step listed in ``dump_steps`` as
  ``<dump><step>-r<rank>.pt``).

A first start fills rows with integer values that do not depend on the world size. The last
stdout line is JSON: the lifecycle events and, for the native context, its process counters.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def int_rows(start: int, stop: int, dim: int) -> torch.Tensor:
    """Integer-valued initial rows, the same for a row whatever the world size."""
    rows = torch.arange(start, stop, dtype=torch.int64)[:, None]
    cols = torch.arange(dim, dtype=torch.int64)[None, :]
    return ((rows * 31 + cols * 7) % 97 - 48).to(torch.float32)


def int_slot(start: int, stop: int) -> torch.Tensor:
    return (torch.arange(start, stop) % 3).to(torch.float32)


def integer_start(ctx) -> None:
    shards = ctx.export_shard()
    for s in shards.values():
        s.weight.copy_(int_rows(s.rows.start, s.rows.stop, s.weight.shape[1]))
        for v in s.slots.values():
            v.copy_(int_slot(s.rows.start, s.rows.stop).reshape(-1, *([1] * (v.dim() - 1))).expand_as(v))
    ctx.import_shard(shards)


def native_factory(spec: dict):
    import functools

    sys.path.insert(0, os.path.join(REPO, "examples", "native_context"))
    from native_context import NativeContext

    from elastic_emb.protocol import TableSpec

    return functools.partial(NativeContext, tables=[TableSpec(**t) for t in spec["tables"]])


def dump(ctx, out: str, name: str) -> None:
    data = {
        n: (
            s.rows.start,
            s.rows.stop,
            s.weight.detach().cpu().clone(),
            {k: v.detach().cpu().clone() for k, v in s.slots.items()},
        )
        for n, s in ctx.export_shard().items()
    }
    torch.save(data, os.path.join(out, f"{name}-r{ctx.topology.rank}.pt"))


def main() -> None:
    from elastic_emb import Lifecycle, LifecycleConfig
    from elastic_emb.topology import Topology

    spec = json.loads(os.environ["ADW_SPEC"])
    if spec["context"] == "native":
        factory = native_factory(spec)

        def train(ctx, step):
            ctx.train_step(step)
    else:
        from tests.helpers import torchrec_model

        factory = torchrec_model.factory(spec)
        train = torchrec_model.train_step
    if spec.get("wait_file"):
        deadline = time.monotonic() + 240
        while not os.path.exists(spec["wait_file"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec['wait_file']} did not appear within 240 s")
            time.sleep(0.05)
    result: dict = {"events": [], "counters": []}
    lc = None
    for i, phase in enumerate(spec["phases"]):
        if phase.get("depart"):
            print(json.dumps({**result, "departed": True}), flush=True)
            os._exit(0)
        if lc is None:
            lc = Lifecycle.start(factory, LifecycleConfig(**spec.get("config", {})))
            if lc.step == -1:
                integer_start(lc.context)
        else:
            if phase.get("gone"):  # what the in-process resize tells the lifecycle before it re-forms
                lc.give_up_on(phase["gone"], "the test's lost node")
            env = dict(os.environ)
            env.update({k: str(v) for k, v in phase["env"].items()})
            lc.on_membership_change(Topology.from_env(env))
        result["events"].append(lc.events[-1].model_dump())
        for step in range(lc.next_step, phase.get("until", -1) + 1):
            train(lc.context, step)
            lc.commit(step)
            if step in phase.get("dump_steps", ()):
                dump(lc.context, spec["out"], f"{phase['dump']}{step}")
        if spec["context"] == "native":
            result["counters"].append(
                {**lc.context.native_counters(), "phase": i, "world_size": lc.topology.world_size}
            )
        if phase.get("dump"):
            dump(lc.context, spec["out"], phase["dump"])
    result["step"] = lc.step
    lc.close()
    print(json.dumps(result), flush=True)


CODE = "from tests.helpers import adapters_worker; adapters_worker.main()"

if __name__ == "__main__":
    main()
