"""Drill scenarios: what cluster to simulate and which faults to inject when.

- :class:`Scenario`, :class:`Fault`: frozen pydantic records, validated (the membership
  simulated fault by fault) before any process starts;
- :data:`PRESETS`: the named drills; :func:`chaos`: a random but reproducible one from a seed;
- :func:`load_scenario`: a preset, ``chaos:SEED``, or a YAML or JSON file.

Design: ``docs/DRILLS.md`` (sections "Scenarios", "Fault kinds" and "Presets").
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

FaultKind = Literal["join", "leave", "kill_node", "kill_agent", "crash_worker", "kill_store", "corrupt"]


class Fault(BaseModel):
    """One fault: what, when (a step or a time), and to which node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FaultKind
    at_step: int | None = Field(default=None, ge=0, description="Inject once this step is committed.")
    at_time: float | None = Field(default=None, ge=0, description="Seconds after the first committed step.")
    node: int | None = Field(default=None, ge=0, description="Target node number; default: the newest live node.")
    duration: float = Field(default=3.0, ge=0, le=120, description="kill_store: seconds the store stays down.")
    member: int | None = Field(default=None, ge=0, description="kill_store: which etcd member; default: the leader.")

    @model_validator(mode="after")
    def _one_trigger(self) -> "Fault":
        if (self.at_step is None) == (self.at_time is None):
            raise ValueError(
                f"fault {self.kind!r}: give exactly one of at_step or at_time "
                f"(got at_step={self.at_step!r}, at_time={self.at_time!r})"
            )
        if self.member is not None and self.kind != "kill_store":
            raise ValueError(f"fault {self.kind!r}: member names an etcd member, only for kill_store; remove it")
        if self.kind == "join" and self.node is not None:
            raise ValueError("fault 'join': node is chosen by the drill (the next free number); remove 'node'")
        return self

    def when(self) -> str:
        """The trigger, for messages.

        Returns:
            ``"step N"`` or ``"t=Ss"``.
        """
        return f"step {self.at_step}" if self.at_step is not None else f"t={self.at_time:g}s"


class Scenario(BaseModel):
    """A whole drill: the cluster, the training run, the faults, the limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    initial_nodes: int = Field(default=1, ge=1, le=8)
    min_nodes: int = Field(default=1, ge=1, le=8)
    max_nodes: int = Field(default=2, ge=1, le=8)
    nproc_per_node: int = Field(default=1, ge=1, le=4)
    steps: int = Field(default=60, ge=1, le=100_000, description="Training steps of the example (0..steps-1).")
    batch: int = Field(default=256, ge=8, le=65_536, description="GLOBAL batch per step, whatever the world size.")
    step_delay: float = Field(default=0.05, ge=0, le=10, description="Seconds each step sleeps, to pace the drill.")
    slow_delay: float = Field(
        default=0.25,
        ge=0,
        le=10,
        description="Seconds per step while a resize is in flight (keeps a short run from ending first; "
        "in process the world trains on while a joiner starts: the presets with joins use 1.0).",
    )
    seed: int = Field(default=0, ge=0)
    rendezvous: Literal["elastic_emb", "c10d"] = Field(
        default="elastic_emb", description="torchrun --rdzv-backend (elastic_emb: the project's backend)."
    )
    mode: Literal["restart", "in_process"] = Field(
        default="in_process",
        description="How the world resizes: in_process (--rdzv-conf resize=in_process: the "
        "survivors re-form in their running processes; the default with rendezvous='elastic_emb') or restart (the "
        "agents restart every worker; the default, and the only mode, with rendezvous='c10d').",
    )
    store: Literal["drill", "agent", "etcd"] = Field(
        default="drill",
        description="Who hosts the rendezvous store: the drill process (a TCPStore), the first agent "
        "(torch's embedded c10d store), or an etcd server the drill starts.",
    )
    etcd_api: Literal["v3", "v2"] = Field(
        default="v3", description="store='etcd': the backend's inner rendezvous, etcd-v3 (default) or etcd-v2."
    )
    etcd_members: int = Field(default=1, ge=1, le=5, description="store='etcd': members of the local etcd cluster.")
    network: Literal["auto", "loopback", "netns"] = Field(
        default="auto", description="netns: one network namespace per node (needs root); auto: netns when it works."
    )
    backend: Literal["gloo", "nccl"] = Field(
        default="gloo", description="Collective backend of the workers; nccl gives each node GPUs no live node holds."
    )
    faults: tuple[Fault, ...] = ()
    workload: Literal["recsys", "torchrec"] = Field(
        default="recsys",
        description="The packaged training script: recsys (EmbContext) or torchrec (TorchRec DMP; "
        "needs the torchrec extra).",
    )
    expect_failure: bool = Field(default=False, description="True for drills that plant a loss on purpose.")
    timeout: float = Field(default=240.0, gt=0, le=3600, description="Hard limit for the whole drill, seconds.")
    max_restarts: int = Field(default=8, ge=0, le=100)

    @model_validator(mode="before")
    @classmethod
    def _default_mode(cls, data):
        # A scenario that names no mode resizes in process (every preset passes in both modes,
        # BENCHMARKS.md), unless its rendezvous is stock c10d, which can only restart the workers.
        if isinstance(data, dict) and "mode" not in data and data.get("rendezvous") == "c10d":
            return {**data, "mode": "restart"}
        return data

    @model_validator(mode="after")
    def _feasible(self) -> "Scenario":
        if not self.min_nodes <= self.initial_nodes <= self.max_nodes:
            raise ValueError(
                f"initial_nodes={self.initial_nodes} must lie in [min_nodes={self.min_nodes}, "
                f"max_nodes={self.max_nodes}]"
            )
        if self.batch < self.max_nodes * self.nproc_per_node:
            raise ValueError(
                f"batch={self.batch} is smaller than the largest world ({self.max_nodes} x "
                f"{self.nproc_per_node}): every rank needs at least one sample; raise batch"
            )
        if self.mode == "in_process" and self.rendezvous != "elastic_emb":
            raise ValueError("mode='in_process' needs rendezvous='elastic_emb' (stock c10d restarts every worker)")
        if self.store == "etcd" and self.rendezvous != "elastic_emb":
            raise ValueError(
                "store='etcd' needs rendezvous='elastic_emb' (it drives etcd through the project's backend)"
            )
        if self.etcd_members > 1 and (self.store != "etcd" or self.etcd_api != "v3"):
            raise ValueError(
                f"etcd_members={self.etcd_members} needs store='etcd' and etcd_api='v3' (torch's etcd-v2 "
                f"client talks to one member)"
            )
        for f in self.faults:
            if f.member is not None and f.member >= self.etcd_members:
                raise ValueError(
                    f"fault kill_store: member={f.member}, but the cluster has members 0..{self.etcd_members - 1}"
                )
        steps = [f.at_step for f in self.faults if f.at_step is not None]
        if steps != sorted(steps):
            raise ValueError(f"step-triggered faults must be in step order, got steps {steps}")
        for f in self.faults:
            if f.at_step is not None and f.at_step >= self.steps - 1:
                raise ValueError(
                    f"fault {f.kind!r} at step {f.at_step} cannot happen: training ends at step "
                    f"{self.steps - 1}; raise steps or move the fault earlier"
                )
            if f.kind == "kill_store" and self.store != "etcd":
                raise ValueError(
                    f"fault 'kill_store' needs store='etcd' (got store={self.store!r}): only an etcd "
                    f"rendezvous store can die and come back; with torch's c10d store, kill node 0 instead"
                )
        self.simulate()  # raises on a membership that leaves [min_nodes, max_nodes]
        return self

    def simulate(self) -> list[list[int]]:
        """The live node numbers after each fault, as the drill will see them (no timing).

        Returns:
            The live nodes at the start, then after each fault (``len(faults) + 1`` lists).

        Raises:
            ValueError: naming the fault that makes the membership infeasible: a join beyond
                ``max_nodes``, a leave or kill below ``min_nodes``, or a fault on a node not live then.
        """
        live = list(range(self.initial_nodes))
        next_node = self.initial_nodes
        history = [list(live)]
        for i, f in enumerate(self.faults):
            where = f"fault #{i} ({f.kind} at {f.when()})"
            if f.kind == "join":
                if len(live) >= self.max_nodes:
                    raise ValueError(f"{where}: {len(live)} nodes already live, max_nodes={self.max_nodes}")
                live.append(next_node)
                next_node += 1
            elif f.kind in ("leave", "kill_node", "kill_agent"):
                target = f.node if f.node is not None else self.default_victim(live, f.kind)
                if target not in live:
                    raise ValueError(f"{where}: node {target} is not live then (live nodes: {live})")
                if len(live) - 1 < self.min_nodes:
                    raise ValueError(f"{where}: would leave {len(live) - 1} nodes, min_nodes={self.min_nodes}")
                live.remove(target)
            elif f.kind in ("crash_worker", "corrupt"):
                target = f.node if f.node is not None else live[-1]
                if target not in live:
                    raise ValueError(f"{where}: node {target} is not live then (live nodes: {live})")
            history.append(list(live))
        return history

    @staticmethod
    def default_victim(live: list[int], kind: str) -> int:
        """The node a fault that names none is aimed at, as an autoscaler removing the newest machine.

        Args:
            live: the live node numbers, oldest first.
            kind: the fault's kind.

        Returns:
            The newest live node; for ``leave``, never node 0 unless it is alone.
        """
        candidates = [n for n in live if n != 0] if kind == "leave" else list(live)
        return (candidates or live)[-1]


# -- presets ------------------------------------------------------------------------------------

_STEP = dict(steps=70, step_delay=0.05)


def _ep8(name: str, loss: str, story: str) -> Scenario:
    """Expert-parallel 8 on CPU (4 nodes x 2 ranks): nodes 1 and 3 lost by ``loss``, then two joins."""
    return Scenario(
        name=name,
        description=f"Expert-parallel 8 on CPU: 4 nodes x 2 ranks; {story}",
        initial_nodes=4,
        min_nodes=2,
        max_nodes=4,
        nproc_per_node=2,
        steps=110,
        step_delay=0.05,
        timeout=600,
        mode="in_process",
        slow_delay=1.0,  # joiners' agents start slowly on a loaded machine (as scale-up)
        faults=(
            Fault(kind=loss, at_step=8, node=1),
            Fault(kind=loss, at_step=20, node=3),
            Fault(kind="join", at_step=35),
            Fault(kind="join", at_step=50),
        ),
    )


PRESETS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="demo",
            description="1 -> 2 -> 1 nodes on loopback with torch's embedded c10d store, resized in process "
            "(the README's demo).",
            # slow_delay=1.0 as in scale-up (below): a joiner slow to import torch on a loaded
            # machine still joins while the world trains.
            initial_nodes=1,
            max_nodes=2,
            store="agent",
            network="loopback",
            steps=90,
            step_delay=0.05,
            mode="in_process",
            slow_delay=1.0,
            faults=(Fault(kind="join", at_step=10), Fault(kind="leave", at_step=55)),
        ),
        Scenario(
            name="scale-up",
            description="A second node joins a running 1-node job.",
            # The joiner starts a process (imports torch) while the world trains on: on a loaded
            # machine that can outlast the remaining steps at 0.25 s each. A join that comes after
            # the end exits 0 (the job is marked complete) but resizes nothing, and the drill fails
            # saying so: the slow steps keep the join inside training. A slowed step ends as soon as
            # the join is due, so the pause reported is still the re-form's.
            initial_nodes=1,
            max_nodes=2,
            faults=(Fault(kind="join", at_step=8),),
            mode="in_process",
            slow_delay=1.0,
            **_STEP,
        ),
        Scenario(
            name="scale-down",
            description="One of two nodes leaves gracefully (SIGTERM to its agent).",
            initial_nodes=2,
            max_nodes=2,
            faults=(Fault(kind="leave", at_step=8),),
            mode="in_process",
            **_STEP,
        ),
        Scenario(
            name="node-loss",
            description="One of two nodes dies at once (SIGKILL of its agent and workers).",
            initial_nodes=2,
            max_nodes=2,
            faults=(Fault(kind="kill_node", at_step=8, node=1),),
            mode="in_process",
            **_STEP,
        ),
        Scenario(
            name="agent-loss",
            description="One of two agents is SIGKILLed alone; its orphaned worker must leave by itself.",
            initial_nodes=2,
            max_nodes=2,
            faults=(Fault(kind="kill_agent", at_step=8, node=1),),
            mode="in_process",
            **_STEP,
        ),
        Scenario(
            name="torchrec",
            description="TorchRec (the torchrec extra): 1 -> 2 nodes, then one dies (2 -> 1); tables equal a "
            "one-process TorchRec replay bit for bit.",
            # Slow steps while a resize is in flight: a joiner's workers import TorchRec before they
            # join, which on a loaded machine can outlast the remaining steps.
            workload="torchrec",
            initial_nodes=1,
            max_nodes=2,
            batch=64,
            steps=40,
            step_delay=0.1,
            slow_delay=1.5,
            timeout=420,
            faults=(Fault(kind="join", at_step=5), Fault(kind="kill_node", at_step=22, node=1)),
            mode="in_process",
        ),
        Scenario(
            name="worker-crash",
            description="A worker of a 2-node job is SIGKILLed; its agent restarts it.",
            initial_nodes=2,
            max_nodes=2,
            faults=(Fault(kind="crash_worker", at_step=8, node=1),),
            mode="in_process",
            **_STEP,
        ),
        Scenario(
            name="flapping",
            description="A node joins and leaves, twice.",
            initial_nodes=1,
            max_nodes=2,
            steps=160,
            step_delay=0.05,
            mode="in_process",
            faults=(
                Fault(kind="join", at_step=8),
                Fault(kind="leave", at_step=45),
                Fault(kind="join", at_step=75),
                Fault(kind="kill_node", at_step=115),
            ),
        ),
        Scenario(
            name="store-host-loss",
            description="The etcd server holding the rendezvous state dies for 3 s while a node joins.",
            # slow_delay=1.0 as in scale-up: keeps the join inside training on a loaded machine.
            initial_nodes=1,
            max_nodes=2,
            store="etcd",
            steps=100,
            step_delay=0.05,
            mode="in_process",
            slow_delay=1.0,
            faults=(Fault(kind="kill_store", at_step=8, duration=3.0), Fault(kind="join", at_step=20)),
        ),
        Scenario(
            name="store-member-loss",
            description="A 3-member etcd cluster holds the rendezvous; its leader is SIGKILLed as a node joins "
            "and comes back 5 s later.",
            initial_nodes=1,
            max_nodes=2,
            store="etcd",
            etcd_members=3,
            steps=100,
            step_delay=0.05,
            mode="in_process",
            faults=(Fault(kind="kill_store", at_step=15, duration=5.0), Fault(kind="join", at_step=15)),
        ),
        Scenario(
            name="gpu-2-1-2",
            description="GPU (nccl, one GPU per node): 2 nodes, one leaves, one joins, one dies, one joins.",
            # Restart mode until it has been drilled in process on two GPUs (`--mode in_process` runs it so).
            initial_nodes=2,
            max_nodes=2,
            backend="nccl",
            network="loopback",
            steps=150,
            step_delay=0.05,
            mode="restart",
            faults=(
                Fault(kind="leave", at_step=10),
                Fault(kind="join", at_step=40),
                Fault(kind="kill_node", at_step=75),
                Fault(kind="join", at_step=105),
            ),
        ),
        _ep8(
            "ep8",
            "kill_node",
            "nodes 1 and 3 SIGKILLed one after the other (8 -> 6 -> 4), then two nodes join (4 -> 6 -> 8).",
        ),
        _ep8("ep8-term", "leave", "SIGTERM flavour: nodes 1 and 3 leave (8 -> 6 -> 4), two nodes join (4 -> 6 -> 8)."),
        Scenario(
            name="corrupt-snapshot",
            description="Plants a loss (bytes of node 0's newest snapshot flipped, then a restart): the drill must fail.",
            initial_nodes=1,
            max_nodes=2,
            steps=60,
            step_delay=0.05,
            expect_failure=True,
            mode="in_process",
            faults=(Fault(kind="corrupt", at_step=10, node=0), Fault(kind="join", at_step=11)),
        ),
    )
}


def chaos(seed: int, *, faults: int = 5, max_nodes: int = 3, steps_between: int = 25) -> Scenario:
    """A random but reproducible scenario: ``faults`` faults drawn with ``random.Random(seed)``.

    Each fault is drawn among the kinds that are feasible at that point (a join only below
    ``max_nodes``, a leave or kill only above one node), so every seed gives a valid scenario.

    Args:
        seed: the random seed (also the training seed and the scenario's name, ``chaos-SEED``).
        faults: how many faults to draw.
        max_nodes: the most nodes at once; the drill starts with one.
        steps_between: the least steps between two faults (up to 9 more are drawn).

    Returns:
        The scenario.
    """
    rng = random.Random(seed)
    live, drawn, step = 1, [], 8
    for _ in range(faults):
        kinds = ["crash_worker"]
        if live < max_nodes:
            kinds += ["join", "join"]
        if live > 1:
            kinds += ["leave", "kill_node"]
        kind = rng.choice(kinds)
        drawn.append(Fault(kind=kind, at_step=step))
        live += {"join": 1, "leave": -1, "kill_node": -1}.get(kind, 0)
        step += steps_between + rng.randrange(0, 10)
    # In process (the default mode) the world trains on while a joiner's worker starts (imports
    # torch): slowed steps of 1.0 s, as in the presets with joins, keep a join drawn late inside
    # training on a loaded machine.
    return Scenario(
        name=f"chaos-{seed}",
        description=f"random chaos, seed {seed}: " + ", ".join(f.kind for f in drawn),
        initial_nodes=1,
        max_nodes=max_nodes,
        steps=step + 20,
        step_delay=0.05,
        slow_delay=1.0,
        faults=tuple(drawn),
        seed=seed,
    )


def load_scenario(spec: str) -> Scenario:
    """The scenario ``spec`` names.

    A file's scenario is named after the file when it names none.

    Args:
        spec: a preset name, ``chaos:SEED``, or a path to a ``.yaml``/``.yml``/``.json`` scenario file.

    Returns:
        The validated scenario.

    Raises:
        ValueError: if ``spec`` is none of those, the file cannot be read or parsed, does not hold
            a mapping, or does not validate (every problem named in one line).
    """
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.startswith("chaos"):
        _, _, seed = spec.partition(":")
        try:
            return chaos(int(seed or 0))
        except ValueError:
            raise ValueError(f"scenario {spec!r}: write chaos:SEED with an integer seed, e.g. chaos:7") from None
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"scenario {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}, chaos:SEED) "
            f"nor an existing .yaml/.json file"
        )
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"scenario file {spec!r}: use a .yaml, .yml or .json suffix")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"scenario file {spec!r} cannot be read ({exc}); check the path and its permissions") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"scenario file {spec!r} is not valid JSON: {exc}; fix the file") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ValueError(
                f"scenario file {spec!r} is not valid YAML{where}: {problem}; fix the file "
                f"(examples/scenarios/rolling.yaml shows the format)"
            ) from None
    if not isinstance(data, dict):
        raise ValueError(f"scenario file {spec!r} must hold a mapping (name:, faults:, ...), got {type(data).__name__}")
    data.setdefault("name", path.stem)
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'scenario'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"scenario file {spec!r} is invalid: {problems}") from None
