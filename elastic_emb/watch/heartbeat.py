"""A worker shows its agent's hang watchdog (``rdzv/hang.py``) that it makes progress.

:func:`beat` touches this worker's progress file (``ELASTIC_EMB_PROGRESS_FILE`` + ``-<local
rank>.json``, which its agent named); the lifecycle beats at every commit, and long work beats
while it advances (``progress.set_on_advance``). The first beat arms the watchdog for this
process; :func:`pause` disarms it where a worker waits on purpose (a drain's idle end, a re-form,
closing), and the next beat arms it again. Outside an elastic_emb agent every call does nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping

from elastic_emb import progress
from elastic_emb.rdzv.localfile import remove_quietly, write_replacing

MIN_EVERY_S = 0.5  # the file's time is set at most this often (a beat per step costs a clock read)

_lock = threading.Lock()
_state: dict = {}  # path, armed, last (monotonic), pid


def _path(env: Mapping[str, str]) -> str | None:
    from elastic_emb.config import load

    prefix = load(env, "progress_file").progress_file
    rank = env.get("LOCAL_RANK", "0")
    if not prefix or not (rank.isascii() and rank.isdigit()):
        return None
    return f"{prefix}-{int(rank)}.json"


def beat(env: Mapping[str, str] | None = None) -> None:
    """This worker made progress: touch its progress file (at most every :data:`MIN_EVERY_S`).

    Never raises: a file that cannot be written leaves the watchdog without news of this worker,
    and a worker it cannot see is never killed (it arms on the first written beat).

    Args:
        env: the environment to read on the first call (default: ``os.environ``).
    """
    now = time.monotonic()
    with _lock:
        if _state.get("pid") != os.getpid():  # first call in this process (or after a fork)
            _state.clear()
            _state["pid"] = os.getpid()
            try:
                _state["path"] = _path(os.environ if env is None else env)
            except Exception:  # a bad variable: no heartbeat (the lifecycle reports its config)
                _state["path"] = None
        path = _state["path"]
        if path is None or (_state.get("armed") and now - _state["last"] < MIN_EVERY_S):
            return
        try:
            if _state.get("armed"):
                os.utime(path)
            else:
                write_replacing(path, json.dumps({"pid": os.getpid()}).encode())
                _state["armed"] = True
                progress.set_on_advance(beat)
            _state["last"] = now
        except FileNotFoundError:  # removed under us: write it again at the next beat
            _state["armed"] = False
        except OSError:
            pass


def pause() -> None:
    """This worker waits on purpose: disarm the watchdog for it until its next :func:`beat`."""
    with _lock:
        path = _state.get("path") if _state.get("pid") == os.getpid() else None
        if path is None or not _state.get("armed"):
            return
        _state["armed"] = False
        progress.set_on_advance(None)
    remove_quietly(path)
