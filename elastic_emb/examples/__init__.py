"""Example workloads that ship with the package (so drills and the demo run from a wheel).

:mod:`elastic_emb.examples.recsys` is the recommendation model that ``elastic-emb demo`` and every
drill preset train; :data:`RECSYS` is its file path, which torchrun takes as its training script.
"""

from __future__ import annotations

from pathlib import Path

RECSYS = Path(__file__).resolve().with_name("recsys.py")

__all__ = ["RECSYS"]
