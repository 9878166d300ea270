"""The errors a drill raises: it could not run, or the replay found a loss."""

from __future__ import annotations

from elastic_emb.errors import ElasticEmbError


class DrillError(ElasticEmbError, RuntimeError):
    """The drill could not run to the end (timeout, agents failed); the message says which and why."""


class LossDetected(ElasticEmbError, AssertionError):
    """The distributed tables differ from the reference replay.

    Args:
        message: what differs, in one line.
        findings: one record per wrong row and step.
    """

    def __init__(self, message: str, findings: list[dict]) -> None:
        super().__init__(message)
        self.findings = findings
