"""A process that exits while its daemon threads are inside blocking torch calls
(tests/test_native_calls.py). ``argv``: mode, store port.

Modes (a module global's ``__del__`` keeps the interpreter's finalisation going for 3 s, the window
in which a blocking call that returns aborts the process):
- ``guarded``: a wait made by the library (``Comm.exchange`` of a communicator that does not
  poll: ``store.wait``, 1 s, inside ``native_call``): the exit waits for it (the exchange ends
  in its TimeoutError before the teardown), and the process exits 0;
- ``mixed``: a polling exchange (interruptible, 60 s timeout), which must end when the exit
  starts, and a wait of 30 s inside ``native_call``, which the exit gives up on after the grace
  (2 s): the exit reports exactly one call still running.
"""

import atexit
import json
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

mode, port = sys.argv[1], int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=60))


class SlowTeardown:
    def __del__(self) -> None:  # runs while the interpreter finalises (module globals cleared)
        time.sleep(3.0)


keep = SlowTeardown()


def comm(interruptible: bool, timeout: float):
    from elastic_emb.state.comm import Comm
    from elastic_emb.topology import Topology

    topo = Topology(
        run_id="exit",
        generation=1,
        rank=0,
        world_size=2,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=2,
        ep_size=2,
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=port,
    )
    return Comm(topo, store, object(), timeout=timeout, purpose="commit", interruptible=interruptible)


exchange: dict = {}  # guarded, mixed: the exchange's thread, and how its call ended


def report() -> None:
    """Registered before elastic_emb is imported, so it runs right after the library's exit hook
    (last in, first out), while threads still run: prints how many calls that hook left in
    flight, then how the exchange ended (waiting for its thread only after the count is taken)."""
    if "thread" in exchange:
        from elastic_emb import native_calls

        print("in flight after the exit hook:", native_calls.in_flight(), flush=True)
        exchange["thread"].join(10)
        print("exchange ended:", json.dumps(exchange.get("ended")), flush=True)


atexit.register(report)


def in_thread(fn) -> threading.Thread:
    def run() -> None:
        try:
            fn()
            ended = "returned"
        except Exception as exc:  # the waits end in errors (timeout, exit): the tests read which
            ended = type(exc).__name__
        if threading.current_thread() is exchange.get("thread"):
            exchange["ended"] = ended

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def until(ready, what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not happen within 60 s")
        time.sleep(0.01)


if mode in ("guarded", "mixed"):
    from elastic_emb import native_calls

    if mode == "guarded":
        waiting = comm(False, 1.0)
        exchange["thread"] = in_thread(lambda: waiting.exchange("never", 0))
        until(lambda: native_calls.in_flight() == 1, "the exchange")  # from here the exit waits for it
    else:
        native_calls.EXIT_GRACE_S = 2.0

        # Each thread on a client of its own, as the library's background threads are
        # (elastic_emb.state.comm.thread_store): a TCPStore client serves one request at a time, so
        # on a shared one the polling thread's next check would queue behind the 30 s wait.
        own = store.clone()

        def stuck() -> None:
            with native_calls.native_call():
                own.wait(["never"], timedelta(seconds=30.0))

        polling = comm(True, 60.0)
        exchange["thread"] = in_thread(lambda: polling.exchange("never", 0))
        in_thread(stuck)
        until(lambda: native_calls.in_flight() == 2, "both calls")
else:
    raise SystemExit(f"mode {mode!r}: use guarded or mixed")
print("exiting", flush=True)
