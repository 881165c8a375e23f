"""A swarm of step cores in memory (no sockets, no event loop, no torch): the step protocol's scenarios in
milliseconds, with faults injected where a test says.

Each :class:`SimPeer` is a :class:`~mapl_swarm.step.core.StepCore` with links, an inbox, projectors
and a fake stage runtime: a forward's payload names what it computed from (step, micro-batch, stage,
the stage's parameter version), a backward adds its micro-batch to what the replica accumulated, an
averaging round (:class:`SimRounds`, per stage) forms among the requests of as many replicas as the
members expect and gives each the union of their micro-batches; an optimizer step takes what was
accumulated. :class:`SimSwarm` runs them: each :meth:`~SimSwarm.tick` either delivers the oldest
message of one link (per-link FIFO, as ZeroMQ) or lets one peer carry out its next intent, chosen
by a seeded generator, so a seed is one interleaving of the swarm. A replica that dies
(:meth:`~SimSwarm.kill`) sends nothing more; its neighbours find it gone (as their liveness
deadline would) a few ticks later; rounds it was in fail.

What the tests read: :attr:`SimSwarm.taken` (every optimizer step each replica took, with the
micro-batches in its gradients), :attr:`SimPeer.records` (stage 0's recorded losses and tokens),
:attr:`SimPeer.rejects`, the peers' ends.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mapl_swarm.replicas.errors import AveragingFailed, RoundCancelled
from mapl_swarm.step import intents as do
from mapl_swarm.step.core import CoreSettings, Phase, StepCore
from mapl_swarm.step.rounds import NONCE_BYTES, ReplicaStep, commitment
from mapl_swarm.wire import Message, MessageType, WireTensor

MT = MessageType
TOKENS = 8
"""Tokens of one micro-batch."""
DETECT_TICKS = 6
"""Ticks after a replica's death before its neighbours find it gone (their liveness deadline)."""
TICK_S = 0.01
"""Simulated seconds per tick."""
FIND_S = 5.0
"""How long one attempt of a round looks for its group before it fails (hivemind's, bounded)."""

CONTROL_ROUTES = ("ready", "commit", "taken", "gone", "redo")
"""ROUTE phases the dispatcher takes (``end`` and ``reopen`` go to the inbox, in the link's order)."""


@dataclass
class SimLink:
    name: str
    stage: int
    contact: str | None
    local_contact: str | None
    welcomed: bool = True
    epoch: int = 0
    peer: tuple[int, int] = (0, 0)
    """The (stage, replica) at its other end."""


class SimLinks:
    def __init__(self, stage: int, num_stages: int) -> None:
        self.up = stage - 1 if stage > 0 else None
        self.down = stage + 1 if stage < num_stages - 1 else None
        self.links: list[SimLink] = []

    def of_stage(self, stage: int | None) -> list[SimLink]:
        return [link for link in self.links if link.stage == stage]

    def named(self, name: str) -> SimLink | None:
        return next((link for link in self.links if link.name == name), None)

    def __iter__(self):
        return iter(list(self.links))

    def set_epoch(self, epoch: int) -> None:
        for link in self.links:
            link.epoch = epoch


class SimInbox:
    def __init__(self) -> None:
        self.items: deque[tuple[Message, SimLink]] = deque()

    def put(self, msg: Message, link: SimLink) -> None:
        self.items.append((msg, link))

    def take_from(self, wanted: Callable[[Message], bool]) -> tuple[Message, SimLink] | None:
        for i, (msg, link) in enumerate(self.items):
            if wanted(msg):
                del self.items[i]
                return msg, link
        return None

    def has(self, wanted: Callable[[Message], bool]) -> bool:
        return any(wanted(msg) for msg, _ in self.items)

    def drop(self, unwanted: Callable[[Message], bool]) -> int:
        before = len(self.items)
        self.items = deque(item for item in self.items if not unwanted(item[0]))
        return before - len(self.items)


@dataclass
class SimProjectors:
    takes: bool
    owns: bool
    inbound_pver: int = 0
    outbound_pver: int = 0


@dataclass
class SimRuntime:
    """What a replica's stage holds: its parameter version (steps taken), the micro-batches whose
    backward it accumulated, the forwards it saved."""

    version: int = 0
    accumulated: list[int] = field(default_factory=list)
    saved: set[int] = field(default_factory=set)


def _tensor(*values: int) -> dict[str, WireTensor]:
    return {"x": WireTensor("int64", np.array(values, dtype=np.int64))}


class SimPeer:
    """Replica ``replica`` of stage ``stage`` of ``swarm``."""

    def __init__(self, swarm: SimSwarm, stage: int, replica: int, *, joining: bool = False) -> None:
        self.swarm, self.stage, self.replica = swarm, stage, replica
        self.contact = f"sim://{stage}.{replica}"
        P = swarm.num_stages
        self.links = SimLinks(stage, P)
        self.inbox = SimInbox()
        self.proj = SimProjectors(takes=stage > 0 and swarm.projectors, owns=stage < P - 1 and swarm.projectors)
        self.rt = SimRuntime()
        self.rejects: list[tuple[str, str]] = []
        self.records: list[tuple[int, float, int]] = []
        self.vals: list[tuple[int, float]] = []
        self.order: list[tuple[int, str, int]] = []
        """(step, "F" or "B", micro-batch) of every train forward and backward, in the order computed."""
        self.downloads: list[str] = []
        """The kinds of state downloads this replica made (``join``, ``resync``)."""
        self.nonces = random.Random(f"nonce/{swarm.seed}/{stage}/{replica}")  # not the swarm's: its moves stay
        self.nonce, self.revealed = self.nonces.randbytes(NONCE_BYTES), None
        """As :class:`~mapl_swarm.replicas.gradients.ReplicaGradients`: committed to, and revealed in the next round."""
        self.alive = True
        self.done: dict | None = None
        self.left: str | None = None
        """Why it left on its own (taken for gone), if it did."""
        self.blocked: do.Intent | None = None
        """The intent this peer waits on (a Wait, or a round in its stage's coordinator)."""
        self.since = 0.0
        s = swarm
        self.core = StepCore(
            CoreSettings(name=f"sim{stage}.{replica}", stage=stage, num_stages=P, M=s.M, steps=s.steps,
                         max_in_flight=s.in_flight, val_interval_steps=s.val_interval, val_batches=s.val_batches,
                         timeout_s=s.timeout_s, tokens_per_step=s.M * TOKENS, replicas=s.replicas,
                         averaged=s.replicas, averaging_timeout_s=s.timeout_s, matchmaking_s=0.0,
                         routing="uniform", routing_seed=s.seed, max_redos=5,
                         starting=s.initial[stage] if s.replicas else 1),
            links=self.links, inbox=self.inbox, projectors=self.proj,
            reject=lambda code, sender, text: self.rejects.append((code, text)), clock=lambda: swarm.now,
            joining=joining)

    @property
    def key(self) -> tuple[int, int]:
        return self.stage, self.replica

    @property
    def peer_id(self) -> str:
        return f"peer-{self.stage}-{self.replica}"

    def delivered(self) -> None:
        """A round goes to the core: its nonce is revealed in the next, which commits to a fresh one."""
        self.revealed, self.nonce = self.nonce, self.nonces.randbytes(NONCE_BYTES)

    def link_to(self, other: SimPeer) -> None:
        """A link to ``other``, speaking this peer's run epoch from the start (a link made while
        training: the peer's linker gives it the schedule's epoch)."""
        name = f"stage{other.stage}@{other.replica}" if self.swarm.replicas else f"stage{other.stage}"
        core = getattr(self, "core", None)
        self.links.links.append(SimLink(name, other.stage, other.contact if self.swarm.replicas else None,
                                        self.contact if self.swarm.replicas else None, peer=other.key,
                                        epoch=core.epoch if core is not None else 0))

    def link_for(self, key: tuple[int, int]) -> SimLink | None:
        return next((link for link in self.links if link.peer == key), None)

    # ------------------------------------------------------------------ carrying out intents
    def runnable(self) -> bool:
        """This peer can make a move now (not blocked, or its wait is over)."""
        if not self.alive or self.done is not None:
            return False
        b = self.blocked
        if b is None:
            return True
        if isinstance(b, do.Wait):
            if self.inbox.has(b.wanted) or self.core.interrupted():
                return True
            if self.swarm.now - self.since >= b.timeout_s:
                if b.fatal:
                    raise AssertionError(f"{self.core.s.name}: no {b.what} within {b.timeout_s} s "
                                         f"(phase {self.core.phase.value}, step {self.core.step})")
                return True
        return False

    def move(self) -> None:
        """Carry out this peer's next intent (or go on after its wait)."""
        self.blocked = None
        self.drain_urgent()
        intent = self.core.next()
        self.drain_urgent()
        self.do(intent)
        self.drain_urgent()

    def drain_urgent(self) -> None:
        for intent in self.core.urgent():
            self.do(intent)

    def do(self, intent: do.Intent) -> None:  # noqa: C901 - one branch per intent
        sw, core = self.swarm, self.core
        match intent:
            case do.SendAct(link, step, micro, payload, eval_mode, pver):
                self.send(link, MT.ACT, step=step, micro=micro, pver=pver,
                          meta={"mode": "eval" if eval_mode else "train"}, tensors=_tensor(*payload))
            case do.SendGrad(link, step, micro, payload, pver):
                self.send(link, MT.GRAD, step=step, micro=micro, pver=pver, tensors=_tensor(*payload))
            case do.SendRoute(link, step, phase, acts, gone, held, epoch, proof):
                meta: dict = {"phase": phase}
                if acts is not None:
                    meta["acts"] = acts
                if gone is not None:
                    meta["gone"] = list(gone)
                if held is not None:
                    meta["held"] = list(held)
                if phase == "redo":  # as a certified peer: its own decision signed, another's passed on
                    meta["cert"], meta["sig"] = proof or (self.peer_id.encode(), bytes(64))
                    self.swarm.redo_makers.append(meta["cert"].decode())
                self.send(link, MT.ROUTE, step=step, meta=meta, epoch=epoch)
            case do.SendReport(link, step, meta):
                self.send(link, MT.REPORT, step=step, meta=dict(meta))
            case do.SendBye(link, step, meta):
                self.send(link, MT.BYE, step=step, meta=dict(meta))
            case do.SendProjector(step, links):
                core.answer(intent, self.proj.outbound_pver)
                for name in links:
                    self.send(name, MT.PROJ, step=step, pver=self.proj.outbound_pver)
            case do.SendProjectorGrad(link, step, n, pver):
                core.answer(intent, ("g", n))
                self.send(link, MT.PROJ_GRAD, step=step, pver=pver, meta={"micro_batches": n}, tensors={"grad": _tensor(n)["x"]})
            case do.Feed(token, micro):
                self.order.append((token.step, "F", micro, token.epoch))
                self.rt.saved.add(micro)
                core.answer(intent, (token.step, micro, self.stage, self.rt.version), None, TOKENS)
                self.sends()
            case do.Forward(token, msg, link):
                self.order.append((token.step, "F", msg.micro, token.epoch))
                self.rt.saved.add(msg.micro)
                last = self.stage == sw.num_stages - 1
                payload = None if last else (token.step, msg.micro, self.stage, self.rt.version)
                core.answer(intent, payload, 1.0 + msg.micro if last else None, TOKENS)
                self.sends()
            case do.Backward(token, micro):
                assert micro in self.rt.saved, (self.core.s.name, micro, self.rt.saved)
                self.order.append((token.step, "B", micro, token.epoch))
                self.rt.saved.discard(micro)
                self.rt.accumulated.append(micro)
                core.answer(intent, None if self.stage == 0 else (token.step, micro, self.stage, 1))
                self.sends()
            case do.EvalFeed(step, index, link):
                self.send(link, MT.ACT, step=step, micro=index, pver=self.proj.outbound_pver,
                          meta={"mode": "eval"}, tensors=_tensor(step, index))
            case do.EvalForward(msg, link):
                last = self.stage == sw.num_stages - 1
                core.answer(intent, None if last else (msg.step, msg.micro), 2.0 if last else None)
                self.sends()
            case do.ApplySlice():
                pass
            case do.LoadProjector(msg, step):
                self.proj.inbound_pver = msg.pver
            case do.AddProjectorGrad():
                pass
            case do.SumLosses(_, losses):
                core.answer(intent, float(sum(losses)))
            case do.MeanLoss(step, losses, to):
                for name in to:
                    self.send(name, MT.REPORT, step=step, meta={"mode": "eval", "loss": sum(losses) / len(losses),
                                                                 "tokens": 0})
            case do.Sync() | do.Average():
                sw.rounds[self.stage].ask(self, intent)
                self.blocked, self.since = intent, sw.now
            case do.CancelRound():
                sw.rounds[self.stage].cancel(self)
            case do.Download():
                sw.download(self, intent)
            case do.SetEpoch(epoch):
                self.links.set_epoch(epoch)
            case do.TakeStep(step):
                sw.taken[self.key].append((step, core.epoch, tuple(sorted(self.rt.accumulated))))
                assert not self.rt.saved, (core.s.name, step, self.rt.saved)
                self.rt.accumulated.clear()
                self.rt.version += 1
                if self.proj.owns:
                    self.proj.outbound_pver += 1
                core.answer(intent, {})
            case do.Abandon():
                self.rt.accumulated.clear()
                self.rt.saved.clear()
            case do.Redo(step, epoch):
                self.links.set_epoch(epoch)
                self.inbox.drop(lambda m: m.epoch < epoch and m.type not in (MT.PROJ, MT.BYE, MT.CODEBOOK_SLICE))
            case do.RecordTrain(step, loss, tokens):
                self.records.append((step, loss, tokens))
            case do.RecordVal(step, loss):
                self.vals.append((step, loss))
            case do.StepEnd() | do.Finish():
                pass
            case do.Boundary(step):
                if sw.drain_at is not None and step >= sw.drain_at:
                    core.answer(intent)
            case do.AskDrain(to, reason):
                for name in to:
                    self.send(name, MT.CHECKPOINT, meta={"phase": "drain_request", "reason": reason})
            case do.Wait():
                self.blocked, self.since = intent, sw.now
            case do.Done(bye):
                self.done = bye or {}
            case do.Leave(why):  # the peer says BYE and exits: its neighbours find it gone
                self.left = why
                sw.kill(self.key)
            case _:
                raise AssertionError(f"no simulation of {intent!r}")

    def sends(self) -> None:
        for intent in self.core.take_sends():
            self.do(intent)

    def send(self, name: str, mtype: MessageType, *, step: int = 0, micro: int = 0, pver: int = 0,
             epoch: int | None = None, meta: dict | None = None, tensors: dict | None = None) -> None:
        link = self.links.named(name)
        assert link is not None, (self.core.s.name, name)
        msg = Message(type=mtype, run_id="sim", src=self.stage, dst=link.stage, step=step, micro=micro, pver=pver,
                      epoch=link.epoch if epoch is None else epoch, meta=meta or {}, tensors=tensors or {})
        self.swarm.wire[(self.key, link.peer)].append(msg)

    # ------------------------------------------------------------------ receiving
    def receive(self, msg: Message, frm: tuple[int, int]) -> None:
        """A message from ``frm`` admitted (what the peer's receive path does): control messages go
        to the core at once, pipeline messages into the inbox."""
        link = self.link_for(frm)
        if link is None or not self.alive:
            return
        core = self.core
        if msg.type is MT.ROUTE and msg.meta["phase"] in CONTROL_ROUTES:
            core.on_control(msg, link.name)
        elif msg.type is MT.REPORT:
            core.on_control(msg, link.name)
        elif msg.type is MT.CHECKPOINT:
            core.stopping.drain_requested(msg.meta["reason"])
        elif msg.type is MT.BYE and link.stage != self.links.up:
            leave = msg.meta.get("reason") == "leave"
            if not core.replica_gone(link, "BYE", after=msg.step if leave else None):
                self.swarm.lost.append((self.key, link.peer))
        else:
            core.arrived(msg, link.name)
            self.inbox.put(msg, link)
        self.drain_urgent()


class SimRounds:
    """The averaging of one stage's replicas: a round forms among the asking replicas once they are as
    many as every one of them expects, all of one step and run epoch; each gets the round as it
    would read it. A replica that dies fails the rounds it was asked in."""

    def __init__(self, swarm: SimSwarm, stage: int) -> None:
        self.swarm, self.stage = swarm, stage
        self.asked: dict[tuple[int, int], tuple[SimPeer, do.Intent, int]] = {}
        self.cancelled: set[tuple[int, int]] = set()
        self.unsure_next = False
        """Fault: the next round's all-reduce breaks at its first member after it began (the others keep it)."""
        self.odd: set[tuple[int, int]] = set()
        """Fault: these replicas hold other parameters (their digest differs) in the next round."""
        self.diverged: dict[tuple[int, int], str] = {}
        """Fault: these replicas hold other parameters (digest) until they load a partner's state."""

    def ask(self, peer: SimPeer, intent: do.Intent) -> None:
        if peer.key in self.cancelled:
            self.cancelled.discard(peer.key)
            self.swarm.later.append(lambda: self._fail(peer, RoundCancelled("cancelled")))
            return
        if isinstance(intent, do.Average):
            announced = [p.contact for p in self.swarm.stage_peers(self.stage)]
            expected = peer.core.rounds.expected(announced)
        else:
            expected = intent.expected
        self.asked[peer.key] = (peer, intent, expected)

    def cancel(self, peer: SimPeer) -> None:
        if peer.key in self.asked:
            del self.asked[peer.key]
            self.swarm.later.append(lambda: self._fail(peer, RoundCancelled("cancelled")))
        else:
            self.cancelled.add(peer.key)

    def _fail(self, peer: SimPeer, exc: AveragingFailed) -> None:
        if peer.alive and isinstance(peer.blocked, (do.Sync, do.Average)):
            peer.blocked_round, peer.blocked = peer.blocked, None
            peer.core.failed(peer.blocked_round, unsure=exc.unsure, behind=False, why=str(exc))
            peer.drain_urgent()

    def died(self, key: tuple[int, int]) -> None:
        """A replica died: its request goes (its partners' wait until they count it out)."""
        self.asked.pop(key, None)

    def expire(self) -> None:
        """Attempts that found no group within :data:`FIND_S` fail (the replicas ask again)."""
        for key, (peer, _, _) in list(self.asked.items()):
            if self.swarm.now - peer.since >= FIND_S:
                del self.asked[key]
                self._fail(peer, AveragingFailed("formed no group"))

    def deadline(self) -> float | None:
        return min((p.since + FIND_S for p, _, _ in self.asked.values()), default=None)

    def can_form(self) -> bool:
        """As many replicas asked as every one of them expects."""
        return bool(self.asked) and len(self.asked) >= max(e for _, _, e in self.asked.values())

    def form(self) -> None:
        """The round of the replicas that asked (:meth:`can_form`)."""
        members = list(self.asked.values())
        expected = max(e for _, _, e in members)
        self.asked.clear()
        steps = {(i.token.step, i.token.epoch) if isinstance(i, do.Average) else (-1, p.core.epoch)
                 for p, i, _ in members}
        group = tuple(sorted(p.peer_id for p, _, _ in members))
        micro = {p.peer_id: (tuple(i.micro) if isinstance(i, do.Average) else ()) for p, i, _ in members}
        loss = sum(i.loss_sum if isinstance(i, do.Average) else 0.0 for _, i, _ in members)
        union = sorted(m for ms in micro.values() for m in ms)
        unsure, self.unsure_next = self.unsure_next, False
        odd, self.odd = self.odd, set()
        commits = {q.peer_id: commitment(q.nonce) for q, _, _ in members}
        reveals = {q.peer_id: q.revealed for q, _, _ in members if q.revealed is not None}
        for n, (peer, intent, _) in enumerate(members):
            behind = {q.peer_id for q, i, _ in members if getattr(i, "behind", False)}
            digests = {q.peer_id: "odd" if q.key in odd else f"behind:{q.peer_id}" if q.peer_id in behind
                       else self.diverged.get(q.key, "d") for q, _, _ in members}
            round_ = ReplicaStep(peer.peer_id, group, digests, micro, loss,
                                 epochs={q.peer_id: (i.token.epoch if isinstance(i, do.Average) else q.core.epoch)
                                         for q, i, _ in members},
                                 contacts={q.peer_id: q.contact for q, _, _ in members},
                                 steps={q.peer_id: (i.token.step if isinstance(i, do.Average) else -1)
                                        for q, i, _ in members}, expected=expected,
                                 leaving=frozenset(q.peer_id for q, i, _ in members
                                                   if getattr(i, "leave", False) or getattr(i, "going", False)),
                                 going=frozenset(q.peer_id for q, i, _ in members if getattr(i, "going", False)),
                                 drain=any(getattr(i, "drain", False) for _, i, _ in members),
                                 behind=frozenset(behind),
                                 commits=commits, reveals=reveals)
            peer.blocked = None
            if isinstance(intent, do.Sync):
                peer.delivered()
                peer.core.answer(intent, round_)
            elif unsure and n == 0:  # its all-reduce broke after it began; the others completed it
                peer.core.failed(intent, unsure=True, why="the all-reduce failed after it began")
            elif len(steps) > 1:
                peer.core.failed(intent, why="members of another step or epoch")
            else:
                if round_.problem(self.swarm.M) is None:
                    peer.rt.accumulated = list(union)  # the average: the whole batch's gradient
                peer.delivered()
                peer.core.answer(intent, round_)
            peer.drain_urgent()
        return True


class SimSwarm:
    """``initial[k]`` replicas of each stage k (``replicas`` False: a chain of one peer per stage)."""

    def __init__(self, initial: tuple[int, ...], *, M: int = 4, steps: int = 3, seed: int = 0, replicas: bool = True,
                 in_flight: int | None = None, val_interval: int = 0, val_batches: int = 2,
                 projectors: bool = True, timeout_s: float = 30.0) -> None:
        self.initial, self.M, self.steps, self.seed, self.replicas = initial, M, steps, seed, replicas
        self.num_stages = len(initial)
        self.in_flight = in_flight or self.num_stages
        self.val_interval, self.val_batches, self.projectors = val_interval, val_batches, projectors
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.now = 0.0
        self.drain_at: int | None = None
        self.peers: dict[tuple[int, int], SimPeer] = {}
        self.wire: dict[tuple[tuple[int, int], tuple[int, int]], deque[Message]] = defaultdict(deque)
        self.taken: dict[tuple[int, int], list[tuple[int, int, tuple[int, ...]]]] = defaultdict(list)
        self.rounds = {k: SimRounds(self, k) for k in range(self.num_stages)}
        self.redo_makers: list[str] = []
        """The maker (its peer id) each ROUTE ``redo`` sent names, in order."""
        self.later: list[Callable[[], None]] = []
        self.downloads: dict[SimPeer, do.Download] = {}
        self.detect: list[tuple] = []
        """(when, dead replica[, neighbour]): its neighbours (that one) find it gone then."""
        self.lost: list[tuple[tuple[int, int], tuple[int, int]]] = []
        """(peer, neighbour) pairs where the neighbour was its stage's last replica (a re-form)."""
        for stage, n in enumerate(initial):
            for r in range(n):
                self.peers[stage, r] = SimPeer(self, stage, r)
        for peer in self.peers.values():
            for other in self.peers.values():
                if abs(other.stage - peer.stage) == 1:
                    peer.link_to(other)
        for peer in self.peers.values():
            peer.core.begin(0, 0)

    def stage_peers(self, stage: int) -> list[SimPeer]:
        return [p for p in self.peers.values() if p.stage == stage and p.alive]

    # ------------------------------------------------------------------ faults
    def kill(self, key: tuple[int, int], found: dict[tuple[int, int], float] | None = None) -> None:
        """Replica ``key`` dies now: it sends nothing more; its neighbours find it gone a few ticks
        later, or neighbour n after ``found[n]`` seconds (each its own liveness deadline)."""
        peer = self.peers[key]
        peer.alive = False
        for (src, dst), queue in self.wire.items():
            if src == key:
                queue.clear()
        self.rounds[peer.stage].died(key)
        if found is None:
            self.detect.append((self.now + DETECT_TICKS * TICK_S, key))
        else:
            self.detect.extend((self.now + after, key, by) for by, after in found.items())

    def suspect(self, key: tuple[int, int], by: tuple[int, int], after: float) -> None:
        """Live replica ``key`` is taken for gone by neighbour ``by`` after ``after`` seconds (its
        messages held back past that neighbour's liveness deadline), and by nobody else."""
        self.detect.append((self.now + after, key, by))

    def join(self, stage: int) -> SimPeer:
        """One more replica of ``stage`` joins the running swarm (linked both ways at once)."""
        r = max(rr for s, rr in self.peers if s == stage) + 1
        peer = self.peers[stage, r] = SimPeer(self, stage, r, joining=True)
        for other in list(self.peers.values()):
            if abs(other.stage - stage) == 1 and other.alive:
                peer.link_to(other)
                other.link_to(peer)
                other.core.on_linked(other.links.links[-1].name)
                other.drain_urgent()
        peer.core.begin(0, 0)
        return peer

    def download(self, peer: SimPeer, intent: do.Download) -> None:
        """``peer`` asks its stage's state from a live partner (answered once one holds a state it takes)."""
        self.downloads[peer] = intent
        peer.blocked = intent

    def _served(self, partner: SimPeer) -> dict:
        return {"step": partner.rt.version, "epoch": partner.core.epoch, "projector": partner.core.projector_step,
                "members": partner.core.members.members_text, "gone": partner.core.members.gone_text}

    def _partners(self, peer: SimPeer) -> list[SimPeer]:
        return [p for p in self.stage_peers(peer.stage) if p is not peer and p.done is None
                and p.core.phase not in (Phase.START, Phase.JOIN)]

    def _sources(self, peer: SimPeer, intent: do.Download) -> list[SimPeer]:
        return [p for p in self._partners(peer) if intent.good(self._served(p))
                and (not intent.sources or p.peer_id in intent.sources)]

    def _downloadable(self, peer: SimPeer, intent: do.Download) -> bool:
        return peer.alive and bool(self._sources(peer, intent))

    def _download(self, peer: SimPeer, intent: do.Download) -> None:
        partner = self._sources(peer, intent)[0]
        diverged = self.rounds[peer.stage].diverged
        if partner.key in diverged:
            diverged[peer.key] = diverged[partner.key]
        else:
            diverged.pop(peer.key, None)
        del self.downloads[peer]
        peer.downloads.append(intent.kind)
        peer.blocked = None
        peer.rt = SimRuntime(version=partner.rt.version)
        peer.proj.inbound_pver, peer.proj.outbound_pver = partner.proj.inbound_pver, partner.proj.outbound_pver
        peer.core.answer(intent, self._served(partner))
        peer.drain_urgent()

    # ------------------------------------------------------------------ running
    def tick(self) -> bool:
        """One move of the swarm; False when nothing can move."""
        self.now += TICK_S
        for when, key, *by in [d for d in self.detect if d[0] <= self.now]:
            self.detect.remove((when, key, *by))
            for peer in self.peers.values():
                if by and peer.key not in by:
                    continue
                link = peer.link_for(key)
                if peer.alive and peer.done is None and link is not None:
                    if not peer.core.replica_gone(link, "silent"):
                        self.lost.append((peer.key, key))
                    peer.drain_urgent()
        while self.later:
            self.later.pop(0)()
        for rounds in self.rounds.values():
            rounds.expire()
        moves: list[Callable[[], None]] = []
        for (src, dst), queue in self.wire.items():
            if queue:
                moves.append(lambda src=src, dst=dst, queue=queue: self.peers[dst].receive(queue.popleft(), src))
        for peer in self.peers.values():
            if peer.runnable():
                moves.append(peer.move)
        for rounds in self.rounds.values():
            if rounds.can_form():
                moves.append(rounds.form)
        for peer, intent in list(self.downloads.items()):
            if self._downloadable(peer, intent):
                moves.append(lambda peer=peer, intent=intent: self._download(peer, intent))
        if moves:
            self.rng.choice(moves)()
            return True
        # nothing can move now: time goes on to the next deadline (a replica found gone, a wait's end)
        deadlines = [when for when, *_ in self.detect]
        deadlines += [d for d in (r.deadline() for r in self.rounds.values()) if d is not None]
        deadlines += [p.since + p.blocked.timeout_s for p in self.peers.values()
                      if p.alive and p.done is None and isinstance(p.blocked, do.Wait)]
        if not deadlines:
            return False
        self.now = max(self.now, min(deadlines))
        return True

    def run(self, max_ticks: int = 200_000, until: Callable[[], bool] | None = None) -> None:
        """Tick until every live peer is done (or ``until()``)."""
        for _ in range(max_ticks):
            if until is not None and until():
                return
            if all(p.done is not None or not p.alive for p in self.peers.values()):
                return
            if not self.tick():
                blocked = {p.core.s.name: (p.core.phase.value, p.core.step, type(p.blocked).__name__)
                           for p in self.peers.values() if p.alive and p.done is None}
                raise AssertionError(f"the swarm is stuck: {blocked}")
        raise AssertionError("the swarm did not finish")

    # ------------------------------------------------------------------ what the tests check
    def steps_taken(self, key: tuple[int, int]) -> list[int]:
        return [step for step, _, _ in self.taken[key]]

    def check_every_micro_batch_once(self) -> None:
        """Every optimizer step a replica took holds each micro-batch of the step exactly once (its
        gradients: its own backwards, or its round's union)."""
        for key, steps in self.taken.items():
            for step, epoch, micro in steps:
                assert micro == tuple(range(self.M)), (key, step, epoch, micro)
