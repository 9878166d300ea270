"""A restart-mode drill's report read as the changes its scenario made, whatever torch's rounds.

In restart mode a node joins (or a crashed worker's node comes back) through a drain and a new
torch round, which completes at its last call (1 s in drills). A node whose agent comes later, an
agent starved on a loaded machine, waits in that round's wait list and comes in by one more
drain and round. The report then shows the extra round as one more segment at the smaller world,
followed by a growth with no fault of its own (cause ``unplanned``, or ``rejoin ...`` after a
crash). :func:`merge_restart_retries` folds each such pair into the one change it is.
"""

from __future__ import annotations


def merge_restart_retries(report: dict) -> tuple[list[int], list[dict]]:
    """The drill's world sizes and resizes with every restart-mode retry round folded in.

    A resize that grows the world with no fault of its own, right after another restart-mode
    resize, is merged with that one: the first one's cause and starting world, the second one's
    end and phases, and the steps both lost (each must be 0: the tests check the sum).

    Args:
        report: what ``run_drill`` returned.

    Returns:
        The world sizes (one per segment, the retry rounds' segments left out) and the resizes.
    """
    worlds = list(report["world_sizes"])
    resizes = [dict(r) for r in report["resizes"]]
    i = 1
    while i < len(resizes):
        prev, cur = resizes[i - 1], resizes[i]
        unplanned = cur["cause"] == "unplanned" or cur["cause"].startswith("rejoin ")
        if prev["mode"] == cur["mode"] == "restart" and unplanned and cur["to_world"] > cur["from_world"]:
            merged = {
                **cur,
                "from_world": prev["from_world"],
                "cause": prev["cause"],
                "steps_lost": prev["steps_lost"] + cur["steps_lost"],
            }
            resizes[i - 1 : i + 1] = [merged]
            del worlds[i]  # segment i: the retry round's, between the two resizes
        else:
            i += 1
    return worlds, resizes
