"""Replicas check each other's work: which shares are drawn and who is excluded (SPEC §9.10 item 15).

Pure data and decisions (no hivemind, no torch), read from what every member of a stage's rounds
gathered, so every member decides alike:

- **The draw.** A round that ran its all-reduce (``prior``) fixed every member's gradient share of
  its step. In the members' next round each reveals the nonce it committed to in ``prior``, before
  any member could know the others'; every member of ``prior`` whose draw over those nonces falls
  below ``replicas.check_fraction`` has its share checked by each of its partners. A member that
  withholds its nonce (or reveals another) is drawn every time: withholding cannot help it.
- **The verdicts.** A checker gathers, in its next rounds, ``audit``: ``[peer, step, ok]`` for every
  share it checked. A share whose recomputation its checker's part does not match within
  :data:`SHARE_TOLERANCE` is not ``ok``.
- **Exclusion.** A member that more than half of a round's members found wrong (for one step) is
  excluded: so one dishonest checker cannot exclude an honest member, and with two replicas
  nobody can settle a dispute (it is logged, not acted on).
- **Stubborn parameters.** A member whose digest differs from the one most members hold in two
  step rounds in a row is excluded too: after the first it loaded a partner's state (SPEC §9.10
  item 6), so an honest replica holds the stage's parameters in the next round; one that lies
  about its digest, or changes its parameters again, would otherwise have every step redone until
  the run ends.

A member whose all-reduce parts do not come twice in a row is excluded as well; each replica
judges that by what came to it (:meth:`~mapl_swarm.replicas.gradients.ReplicaGradients._broken`),
not from gathered data.
"""

from __future__ import annotations

import hashlib

from mapl_swarm.step.rounds import ReplicaStep, Verdict, commitment, read_verdicts

__all__ = ["SHARE_TOLERANCE", "Verdict", "drawn", "read_verdicts", "Accusations", "DRAW_CONTEXT", "divergent",
           "stubborn"]

SHARE_TOLERANCE = 1e-2
"""How far (‖share − recomputed‖ / ‖recomputed‖, over a checker's part) a share may be from its
recomputation and still be the member's work: a checker recomputes from its own copy of the
stage's parameters (within ``SKETCH_TOLERANCE`` of the member's on other kernels) on its own
kernels, which moved a share by at most 1.01e-5 of its norm (AVX2 against ``default``, 206 checks,
BENCHMARKS.md); the attacks it must catch (a share scaled, flipped, replaced by noise, or biased by
10%) move it by 10% and more."""
DRAW_CONTEXT = b"mapl-check v1\0"
"""Prefix of the draw's hash (another draw over the same nonces, a tie's, is unrelated to it)."""
ACCUSATION_STEPS = 16
"""Steps an accusation is remembered for while its other checkers' verdicts come in."""


def drawn(prior: ReplicaStep, now: ReplicaStep, fraction: float) -> list[str]:
    """The members of ``prior`` (a round whose all-reduce ran) whose shares of its step are checked,
    drawn in ``now`` (the members' next round) at rate ``fraction``: only members that computed
    micro-batches, are still in ``now`` and have a partner there. Every member reads the same."""
    if fraction <= 0:
        return []
    fair = [p for p in now.group if p in now.reveals and commitment(now.reveals[p]) == prior.commits.get(p)]
    step = next(iter(prior.steps.values()), 0)
    seed = hashlib.sha256(DRAW_CONTEXT + step.to_bytes(8, "big", signed=True)
                          + b"".join(now.reveals[p] for p in fair)).digest()
    out = []
    for peer in prior.group:
        if not prior.micro.get(peer) or peer not in now.group or not set(now.group) & (set(prior.group) - {peer}):
            continue
        if peer not in fair:
            out.append(peer)  # it withheld its nonce: drawn
            continue
        draw = int.from_bytes(hashlib.sha256(seed + peer.encode()).digest()[:8], "big") / 2.0 ** 64
        if draw < fraction:
            out.append(peer)
    return out


class Accusations:
    """The verdicts a stage's rounds gathered, by accused member and step: who found its share wrong."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, int], set[str]] = {}
        self.excluded: set[str] = set()

    def add(self, round_: ReplicaStep) -> list[tuple[str, int, frozenset[str]]]:
        """Count ``round_``'s verdicts; the members newly excluded (more than half of ``round_``'s
        members found their share of a step wrong), each with that step and its accusers."""
        newest = 0
        for checker, verdicts in round_.verdicts.items():
            for v in verdicts:
                newest = max(newest, v.step)
                if not v.ok and v.peer != checker:
                    self._by.setdefault((v.peer, v.step), set()).add(checker)
        out = []
        for (peer, step), accusers in sorted(self._by.items()):
            if peer not in self.excluded and 2 * len(accusers) > len(round_.group):
                self.excluded.add(peer)
                out.append((peer, step, frozenset(accusers)))
        for key in [k for k in self._by if k[1] < newest - ACCUSATION_STEPS]:
            del self._by[key]
        return out

    def exclude(self, peer: str) -> bool:
        """Exclude ``peer`` for another reason (:func:`stubborn`); False when it was already."""
        if peer in self.excluded:
            return False
        self.excluded.add(peer)
        return True

    def accusers(self, peer: str, step: int) -> frozenset[str]:
        return frozenset(self._by.get((peer, step), ()))


def divergent(round_: ReplicaStep) -> set[str]:
    """The members of ``round_`` (a step's round) that hold another digest than the one most of its
    members hold (none when the members agree, or when digests tie: nobody's is the stage's)."""
    if round_.agrees:
        return set()
    tied = round_.tied
    return {p for p in round_.group if round_.digests[p] != tied[0]} if len(tied) == 1 else set()


def stubborn(round_: ReplicaStep, previous: ReplicaStep | None) -> list[str]:
    """The members divergent in ``round_`` and in ``previous`` (the stage's step round before it, in
    which they were told to load a partner's state), in peer-id order."""
    if previous is None:
        return []
    return sorted(divergent(round_) & divergent(previous))
