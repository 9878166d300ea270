"""The running workers' side of a node joining a world formed in process.

:class:`JoinPlan` keeps what one running worker has read of the joiners' registrations and of
the next generation's plan ("include these joiners after step ``n``"), which only the planner,
the first member node's local rank 0, publishes, so that every worker re-forms after the same
step. :func:`raise_generations` is the rule every writer of a new generation's keys follows first.

Design: ``docs/RESIZE.md`` (section "The join plan").
"""

from __future__ import annotations

import json

from elastic_emb.errors import ElasticEmbError
from elastic_emb.events import get_logger
from elastic_emb.rdzv.keys import (
    KEY_GENERATION_MARK,
    KEY_JOINER,
    KEY_PLAN,
    inproc_prefix,
    inproc_root,
)
from elastic_emb.rdzv.signed_cas import raise_mark
from elastic_emb.rdzv.signing import Signer, read_signed

log = get_logger("elastic_emb.inprocess.resize")


class JoinPlan:
    """What one running worker knows of the joiners and of the next generation's plan.

    ``joiners`` lists the registered joiners not yet in the world, in order.

    Args:
        reader: the watcher's ``RendezvousReader`` (its store and run id).
        signer: signs and verifies the plan and the registrations.
    """

    def __init__(self, reader, signer: Signer) -> None:
        self._reader = reader
        self._signer = signer
        self.joiners: list[str] = []  # registered joiners not yet in the world, in order
        self._plan: dict | None = None  # the next generation's plan to include joiners, once read

    def key(self, generation: int) -> str:
        """The store key of a generation's join plan.

        Args:
            generation: the generation the plan forms.

        Returns:
            The key under the generation's in-process prefix.
        """
        return inproc_prefix(self._reader.run_id, generation) + KEY_PLAN

    def read(self, generation: int) -> dict | None:
        """The join plan of ``generation``, read once and then kept.

        Args:
            generation: the next generation.

        Returns:
            The plan (``generation``, ``after_step``, ``joiners``), or None while there is none.

        Raises:
            ElasticEmbError: the signed value under the plan's key is not a plan of ``generation``.
        """
        if self._plan is not None and self._plan["generation"] == generation:
            return self._plan
        key = self.key(generation)
        value = read_signed(self._reader.store, self._signer, key, log)
        if value is None:
            return None
        plan = json.loads(value)
        if (
            plan.get("generation") != generation
            or not isinstance(plan.get("after_step"), int)
            or not isinstance(plan.get("joiners"), list)
        ):
            raise ElasticEmbError(f"join plan under {key} is malformed: {value[:200]!r}")
        self._plan = plan
        return plan

    def publish(self, generation: int, after_step: int, joiners: list[str]) -> dict:
        """The planner: publish (signed) that ``joiners`` join ``generation`` after ``after_step``.

        The run's generation high-water mark is raised first (:func:`raise_generations`).

        Args:
            generation: the next generation.
            after_step: the last step of the current generation.
            joiners: the nodes to include, in order.

        Returns:
            The plan published.
        """
        key = self.key(generation)
        plan = {"generation": generation, "after_step": after_step, "joiners": list(joiners)}
        raise_generations(self._reader.store, self._reader.run_id, plan["generation"], self._signer)
        self._reader.store.set(key, self._signer.sign(key, json.dumps(plan)))
        self._plan = plan
        log.info(
            "resize.join_planned", generation=plan["generation"], after_step=plan["after_step"], joiners=plan["joiners"]
        )
        return plan

    def ready(self, members: tuple[str, ...], present) -> list[str]:
        """The registered joiners that are ready to be included.

        Re-derived at each call from signed records and torch's state, with no counter: a node
        whose agent is a participant of the rendezvous (``present``), not a member, counts once its
        signed registration (``joiner/<node>``, value the node id) verifies. A store writer can
        neither register a node (unsigned) nor hide one beyond deleting its key (the joiner then
        times out and asks for a restart-mode round, which includes it).

        Args:
            members: the current generation's nodes (never joiners).
            present: the nodes whose agents are participants of the rendezvous, in the state's
                order (a set is taken sorted).

        Returns:
            The joiners, in the order they were first read, that are not members and whose agent
            is present.
        """
        store = self._reader.store
        root = inproc_root(self._reader.run_id)
        order = sorted(present) if isinstance(present, (set, frozenset)) else list(present)
        for node in order:
            if node in members or node in self.joiners:
                continue
            key = root + KEY_JOINER + node
            value = read_signed(store, self._signer, key, log)  # absent: not registered yet, read again
            if value is not None and value.decode("utf-8", "replace") == node:
                self.joiners.append(node)
        return [n for n in self.joiners if n in set(order)]

    def included(self, nodes: tuple[str, ...]) -> None:
        """A new generation formed: its joiners are in, its plan is spent.

        Their registrations are spent: deleted, or a joiner that was included and then died would
        count as registered again once the world re-formed without it (its agent stays a
        participant until its heartbeat expires), and the next world would wait for it. A worker of
        that node started later registers anew.

        Args:
            nodes: the new generation's nodes.
        """
        root = inproc_root(self._reader.run_id)
        for node in nodes:
            if node in self.joiners:
                try:
                    self._reader.store.delete_key(root + KEY_JOINER + node)
                except Exception as exc:  # a store without deletes: the planner's list still drops it
                    log.warning("resize.registration_not_deleted", node=node, error=str(exc)[:200])
        self.joiners = [n for n in self.joiners if n not in nodes]
        self._plan = None


def raise_generations(store, run_id: str, generation: int, signer: Signer) -> None:
    """Raise the run's in-process high-water mark (``KEY_GENERATION_MARK``) to at least ``generation``.

    Call it before writing any key of that generation: the agents start a torch round at
    ``round + mark``, so a round after a fallback never reuses this generation. The mark is a
    signed value raised by compare-and-set (``rdzv/signed_cas.py``), not a counter: a store
    writer cannot raise it, and a value of theirs is replaced. Two raisers at once end at the
    higher value.

    Args:
        store: the rendezvous store.
        run_id: the run.
        generation: the generation about to be written.
        signer: the job's control-key signer.

    Raises:
        ElasticEmbError: every compare-and-set lost for 10 s (a writer replacing it in a loop):
            the re-form fails and the agents start a restart-mode round.
    """
    raise_mark(store, signer, inproc_root(run_id) + KEY_GENERATION_MARK, generation, log=log)
