"""What one averaging round of a stage's replicas gave, as every member reads it (SPEC §9.10 item 6).

Pure data and checks (no hivemind, no torch): the averager (:mod:`mapl_swarm.replicas.gradients`)
builds a :class:`ReplicaStep` from what the round's members gathered, and the step core
(:mod:`mapl_swarm.step.core`) decides from it whether the step can be taken, is repaired or redone.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReplicaStep", "Verdict", "read_verdicts", "read_round", "round_counts", "SYNC_STEP", "RESUME_STEP", "NONCE_BYTES", "commitment",
           "SKETCH_TOLERANCE"]

SYNC_STEP = -1
"""The step a sync round gathers (it comes before the first step)."""
RESUME_STEP = -2
"""The step a resume round gathers (a resumed run's, before its replicas load a checkpoint)."""
SKETCH_TOLERANCE = 1e-5
"""How far apart replicas on other kernels may hold their parameters and still count as holding
the same (SPEC §9.10 item 6), relative to each tensor's magnitude: the rounding differences of a
stage on mixed CPU kernels stayed below it for 200 steps, or crossed it twice in 200
(``bench/mixed_kernels.py``), and a replica that drifts past it re-syncs."""
NONCE_BYTES = 32
"""A round's nonce: a member commits to a fresh one in each round and reveals it in its next
(SPEC §9.10 item 6: the draw that settles a tie among digests)."""


def commitment(nonce: bytes) -> str:
    """What a member gathers as ``commit`` for ``nonce``: its SHA-256, hex."""
    return hashlib.sha256(nonce).hexdigest()


def _sketch(value: Any) -> bool:
    """A gathered ``sketch``: pairs of finite floats."""
    return (isinstance(value, list) and len(value) % 2 == 0
            and all(type(x) is float and math.isfinite(x) for x in value))


def _nonce(text: Any) -> bytes | None:
    """A gathered ``reveal``: a hex nonce of :data:`NONCE_BYTES`, else None."""
    if not isinstance(text, str) or len(text) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Verdict:
    """One checker's finding on one member's share of one step."""

    peer: str
    step: int
    ok: bool

    def gathered(self) -> list:
        return [self.peer, self.step, self.ok]


def read_verdicts(value: object) -> tuple[Verdict, ...] | None:
    """A member's gathered ``audit``, or None when it is not a list of ``[peer, step, ok]``."""
    if not isinstance(value, list) or len(value) > 64:
        return None
    out = []
    for v in value:
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and type(v[1]) is int
                and v[1] >= 0 and isinstance(v[2], bool)):
            return None
        out.append(Verdict(v[0], v[1], v[2]))
    return tuple(out)


@dataclass(frozen=True)
class ReplicaStep:
    """What one averaging round gave (SPEC §9.10 item 6)."""

    me: str
    """This replica's peer id."""
    group: tuple[str, ...]
    """The members' peer ids, sorted: a replica's place in it is its rank."""
    digests: dict[str, str]
    """Each member's parameter digest before the step (peer id -> hex)."""
    micro: dict[str, tuple[int, ...]]
    """Each member's train micro-batches of the step (indices within the step), accumulated."""
    loss_sum: float
    """The members' summed micro-batch losses (the last stage; 0 elsewhere)."""
    sent_bytes: int = 0
    received_bytes: int = 0
    """The tensor bytes this replica's all-reduce of the round sent and received."""
    epochs: dict[str, int] = field(default_factory=dict)
    """Each member's run epoch (a step redone after a replica left is one epoch later)."""
    contacts: dict[str, str] = field(default_factory=dict)
    """Each member's pipeline contact (what its neighbours' links name it by)."""
    steps: dict[str, int] = field(default_factory=dict)
    """Each member's step (-1: the sync round before the first step)."""
    expected: int = 1
    """The most replicas any member expected in the round (it counts only with that many)."""
    leaving: frozenset[str] = frozenset()
    """The members asked to stop (a signal: SPEC §9.10 item 14), going or not."""
    going: frozenset[str] = frozenset()
    """The members that leave after the round's step: each asked to stop in the stage's last round
    too, which kept a replica (a round's grace, in which partners signalled at about the same
    moment say so and the stage drains instead)."""
    drain: bool = False
    """A member asked the swarm to drain (stage 0 stops after the round's step)."""
    behind: frozenset[str] = frozenset()
    """The members that resumed behind their stage (a sync round's: they hold no file of the agreed
    step, SPEC §9.10 item 13): they load a partner's state, whatever their digests."""
    commits: dict[str, str] = field(default_factory=dict)
    """Each member's commitment to its nonce of this round (:func:`commitment`, hex)."""
    reveals: dict[str, bytes] = field(default_factory=dict)
    """Each member's nonce of its previous round, where it gathered a well-formed one."""
    frames: dict[str, str] = field(default_factory=dict)
    sketches: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Each member's state frame and sketch (:func:`~mapl_swarm.replicas.state.state_summary`), where
    it gathered well-formed ones."""
    verdicts: dict[str, tuple[Verdict, ...]] = field(default_factory=dict)
    """Each member's findings on its partners' shares (:class:`Verdict`), where it
    gathered a well-formed ``audit`` (replicas that check each other's work, SPEC §9.10 item 15)."""

    @property
    def stops(self) -> bool:
        """The stage cannot go on after the round's step: a member asked for a drain, or every member
        leaves (nobody would be left): the swarm drains."""
        return self.drain or set(self.leaving) >= set(self.group)

    @property
    def counts(self) -> dict[str, int]:
        """Each member's number of train micro-batches of the step."""
        return {p: len(m) for p, m in self.micro.items()}

    @property
    def group_size(self) -> int:
        return len(self.group)

    @property
    def rank(self) -> int:
        return self.group.index(self.me)

    @property
    def in_sync(self) -> bool:
        """Every member started the step from the parameters this replica holds, bit for bit."""
        return len(set(self.digests.values())) == 1

    @property
    def close(self) -> bool:
        """Every member holds the same frame and a sketch within :data:`SKETCH_TOLERANCE` of the
        first member's (replicas on other kernels: SPEC §9.10 item 6)."""
        if set(self.frames) != set(self.group) or set(self.sketches) != set(self.group) \
                or len(set(self.frames.values())) != 1 or len({len(v) for v in self.sketches.values()}) != 1:
            return False
        first = self.sketches[self.group[0]]
        for other in self.sketches.values():
            for k in range(0, len(first), 2):  # (sum, sum of squares) of each tensor, against ||x|| and ||x||^2
                squares = max(first[k + 1], 1e-30)
                if abs(other[k + 1] - first[k + 1]) > SKETCH_TOLERANCE * squares \
                        or abs(other[k] - first[k]) > SKETCH_TOLERANCE * math.sqrt(squares):
                    return False
        return True

    @property
    def agrees(self) -> bool:
        """The members hold the same parameters: bit for bit, or :attr:`close`."""
        return self.in_sync or self.close

    def _current(self) -> list[str]:
        """The members whose digests count: those not :attr:`behind`, unless every member is."""
        return [p for p in self.group if p not in self.behind] or list(self.group)

    @property
    def tied(self) -> list[str]:
        """The digests the most counting members hold (sorted): one, unless several tie."""
        held = Counter(self.digests[p] for p in self._current())
        most = max(held.values())
        return sorted(d for d, n in held.items() if n == most)

    def holders(self, digest: str) -> list[str]:
        """The members holding ``digest``."""
        return [p for p in self.group if self.digests[p] == digest]

    def reference(self, prior: ReplicaStep | None = None) -> str | None:
        """The stage's digest when the members' differ (SPEC §9.10 item 6): the one most members
        hold (members :attr:`behind` count only when every member is). Among as many, nobody's
        word decides: the tie is drawn in the members' next round (``prior`` is this replica's
        round before this one): with the same members, tied there too, each member's nonce
        revealed here that matches its commitment there enters the draw, ``sha256`` of those
        nonces in ``group`` order picks among the tied digests still held by a member that held
        it then and revealed. None: undecided (no such prior round: this round's commitments
        decide the next). Every member reads the same."""
        tied = self.tied
        if len(tied) == 1:
            return tied[0]
        if prior is None or prior.group != self.group or len(prior.tied) < 2:
            return None
        fair = [p for p in self.group if p in self.reveals and commitment(self.reveals[p]) == prior.commits.get(p)]
        candidates = [d for d in prior.tied if any(prior.digests[p] == d == self.digests[p] for p in fair)]
        if not candidates:
            return None
        draw = hashlib.sha256(b"".join(self.reveals[p] for p in fair)).digest()
        return candidates[int.from_bytes(draw[:8], "big") % len(candidates)]

    def problem(self, micro_batches: int) -> str | None:
        """Why the round cannot make the step (its members are in different epochs, a micro-batch
        of the step's ``micro_batches`` is missing or counted twice, or the members hold different
        parameters), or None."""
        if len(set(self.epochs.values())) > 1:
            return f"the replicas are in different epochs ({sorted(set(self.epochs.values()))})"
        seen = Counter(m for ms in self.micro.values() for m in ms)
        missing = [m for m in range(micro_batches) if m not in seen]
        twice = sorted(m for m, n in seen.items() if n > 1 or not 0 <= m < micro_batches)
        if missing or twice:
            counted = sum(seen.values())
            return (f"the replicas' micro-batches add up to {counted}, not the step's {micro_batches} once each "
                    f"({len(missing)} missing, {len(twice)} counted twice or out of range; "
                    f"{', '.join(f'{p[-8:]}: {n}' for p, n in sorted(self.counts.items()))})")
        if not self.agrees:
            return f"the replicas held different parameters before the step ({len(set(self.digests.values()))} digests)"
        return None


def read_round(me: str, data: dict[str, Any], sent: int = 0, received: int = 0) -> ReplicaStep | None:
    """The round whose members (peer id as text) gathered ``data`` (:meth:`~mapl_swarm.replicas.gradients.ReplicaGradients._gather`),
    as replica ``me`` sees it; None when a member gathered something else."""
    def valid(v: Any) -> bool:
        return (isinstance(v, dict) and isinstance(v.get("digest"), str) and isinstance(v.get("micro"), list)
                and all(type(m) is int for m in v["micro"]) and isinstance(v.get("loss"), float)
                and type(v.get("epoch")) is int and isinstance(v.get("contact"), str)
                and type(v.get("step")) is int and type(v.get("expected")) is int)

    if not data or not all(valid(v) for v in data.values()):
        return None
    return ReplicaStep(me, tuple(sorted(data)), {p: v["digest"] for p, v in data.items()},
                       {p: tuple(v["micro"]) for p, v in data.items()}, sum(v["loss"] for v in data.values()),
                       sent, received, {p: v["epoch"] for p, v in data.items()},
                       {p: v["contact"] for p, v in data.items()}, {p: v["step"] for p, v in data.items()},
                       max(v["expected"] for v in data.values()),
                       frozenset(p for p, v in data.items() if v.get("leave") is True or v.get("going") is True),
                       frozenset(p for p, v in data.items() if v.get("going") is True),
                       any(v.get("drain") is True for v in data.values()),
                       frozenset(p for p, v in data.items() if v.get("behind") is True),
                       {p: v["commit"] for p, v in data.items() if isinstance(v.get("commit"), str)},
                       {p: n for p, v in data.items() if (n := _nonce(v.get("reveal"))) is not None},
                       {p: v["frame"] for p, v in data.items() if isinstance(v.get("frame"), str)},
                       {p: tuple(v["sketch"]) for p, v in data.items() if _sketch(v.get("sketch"))},
                       {p: found for p, v in data.items() if (found := read_verdicts(v.get("audit"))) is not None})


def round_counts(micro_batches: int, data: dict[str, Any]) -> bool:
    """Whether the round whose members gathered ``data`` makes the step of a stage of
    ``micro_batches``: as many members as any expected, all at one step and run epoch, every
    micro-batch once, equal digests. The averager runs the all-reduce of such a round only
    (:data:`~mapl_swarm.replicas.averaging.Usable`): a round that cannot count (a replica left with micro-batches
    of the step) costs its members no tensor bytes, which would delay the redo on their links."""
    round_ = read_round("", data)
    return (round_ is not None and round_.group_size >= round_.expected and len(set(round_.steps.values())) == 1
            and len(set(round_.epochs.values())) == 1 and round_.problem(micro_batches) is None)
