"""The dense part of the test workers (``RDZV_TEST_DENSE=1``): a replicated ``nn.Linear`` trained
with Adam and a step schedule, and an :class:`~elastic_emb.data.ElasticSampler`, all passed to the
lifecycle as app state.

Each step's gradient is the sum of :data:`SLOTS` slot gradients, each a multiple of 1/16 below 1
in magnitude; rank ``r`` of ``W`` sums the slots ``s % W == r`` and an all-reduce adds the ranks'
sums. Every partial sum is exact in fp32, so the gradient is the same bits whatever the world
size and whoever computed which slot, and :func:`replay` (one process, every slot) gives the
parameters and Adam's moments of any step bit for bit."""

from __future__ import annotations

import hashlib

import torch

from elastic_emb.data import ElasticSampler

SLOTS = 16
NUM_SAMPLES = 97
BATCH = 2  # samples per rank per step


def slot_grad(step: int, slot: int, numel: int) -> torch.Tensor:
    k = torch.arange(numel, dtype=torch.int64)
    return (((step * 31 + slot * 17 + k * 5) % 9) - 4).to(torch.float32) / 16


class DensePart:
    """The dense state of one rank, built the same way on every rank and in the replay."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(4, 2)
        with torch.no_grad():
            for i, p in enumerate(self.model.parameters()):  # exactly representable, no RNG
                p.copy_((torch.arange(p.numel()) % 7 - 3 + i).reshape(p.shape).to(torch.float32) / 8)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=1 / 64, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=5, gamma=0.5)
        self.sampler = ElasticSampler(NUM_SAMPLES, BATCH, seed=5)

    def objects(self) -> dict:
        return {"model": self.model, "optim": self.optim, "sched": self.sched, "sampler": self.sampler}

    def _apply(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.model.parameters(), grads):
            p.grad = g.reshape(p.shape).clone()
        self.optim.step()
        self.sched.step()

    def grads(self, step: int, slots: range) -> list[torch.Tensor]:
        """Per parameter, the flat sum of the gradients of ``slots`` at ``step``."""
        flat = []
        for p in self.model.parameters():
            g = torch.zeros(p.numel(), dtype=torch.float32)
            for s in slots:
                g += slot_grad(step, s, p.numel())
            flat.append(g)
        return flat

    def train(self, step: int, rank: int, world_size: int, group) -> list[int]:
        """One step on ``rank`` of ``world_size`` (collective over ``group``). Returns the samples
        this rank read."""
        samples = self.sampler.indices(rank, world_size).tolist()
        flat = self.grads(step, range(rank, SLOTS, world_size))
        if world_size > 1:
            for work in [group.allreduce([g]) for g in flat]:  # the context's own gloo group
                work.wait()
        self._apply(flat)
        self.sampler.advance(world_size)
        return samples

    def digest(self) -> str:
        """The bits of the parameters, Adam's state and the schedule (not the sampler's cursor,
        which depends on the world sizes of the history)."""
        h = hashlib.sha256()
        for p in self.model.parameters():
            h.update(p.detach().numpy().tobytes())
        for state in self.optim.state.values():
            for key in sorted(state):
                h.update(key.encode() + torch.as_tensor(state[key]).numpy().tobytes())
        h.update(repr(self.sched.state_dict()).encode())
        return h.hexdigest()


def replay(last_step: int) -> str:
    """The dense state's digest after steps 0..last_step in one process (every slot summed)."""
    dense = DensePart()
    for step in range(last_step + 1):
        dense._apply(dense.grads(step, range(SLOTS)))
    return dense.digest()
