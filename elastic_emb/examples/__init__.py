"""Example workloads that ship with the package (so drills and the demo run from a wheel).

:mod:`elastic_emb.examples.recsys` is the recommendation model that ``elastic-emb demo`` and the
drill presets train; :data:`RECSYS` is its file path, which torchrun takes as its training script.
:mod:`elastic_emb.examples.dlrm` (:data:`TORCHREC`) is a TorchRec DLRM made elastic, the
workload of the ``torchrec`` preset (it needs the ``torchrec`` extra).
"""

from __future__ import annotations

from pathlib import Path

RECSYS = Path(__file__).resolve().with_name("recsys.py")
TORCHREC = Path(__file__).resolve().with_name("dlrm.py")  # not torchrec.py: run as a script, it would shadow torchrec
WORKLOADS = {"recsys": RECSYS, "torchrec": TORCHREC}  # a drill scenario's ``workload`` -> its script

__all__ = ["RECSYS", "TORCHREC", "WORKLOADS"]
