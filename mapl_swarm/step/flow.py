"""Serving a step (SPEC §9.7 items 1-3, §9.10 items 3-5): which work comes next, and what each message of
the step does.

Each step a stage takes its ACTs from upstream (stage 0: reads its data), computes them forward and
sends them on downstream, takes their GRADs back, computes them backward and sends those upstream.
:class:`Flow` decides the order and keeps the books (:class:`~.state.StepState`):

- **A chain** (one peer per stage, no ROUTE on the wire): the step is the stage's 1F1B list of
  actions (:func:`~mapl_swarm.step.actions.stage_actions`, the in-process driver's too): each
  action takes its own input and nothing else, so every stage computes in the in-process order
  and gradients accumulate in micro-batch order. Its one link each way is ``ready`` and announces
  all M ACTs without a message.
- **With replicas**: a receiver says ROUTE ``ready`` on each upstream link; a sender routes each
  computed ACT to one of the ready downstream links (:class:`~.router.Router`), says ``end`` once
  it computed every ACT it will; a stage computes what comes, GRADs first (activations are freed
  as early as they can be); stage 0 keeps ``max_in_flight`` micro-batches in flight per ready link.

A message that is not due is dropped through ``reject`` with its code and the rule. What a replica
that leaves changes (re-sends, held micro-batches, the repair's deadline) is :mod:`~.repair`'s.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from mapl_swarm.step.actions import Op, stage_actions
from mapl_swarm.step.assignment import replica_share
from mapl_swarm.step import intents as do
from mapl_swarm.step.state import StepState
from mapl_swarm.wire import Message, MessageType

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core

log = logging.getLogger(__name__)

__all__ = ["Flow", "act_digest", "SERVED"]

MT = MessageType


_LATER_READIES = 64
"""ROUTE ``ready`` of later steps kept at most (each neighbour replica sends one per step)."""


class _Served(do.Intent):
    """The step's work is done here (the core flushes it)."""


SERVED = _Served()


def act_digest(msg: Message) -> bytes:
    """What identifies a train ACT's content: its versions and tensors (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256(f"{msg.pver}/{msg.cver}".encode())
    for name in sorted(msg.tensors):
        t = msg.tensors[name]
        h.update(f"/{name}/{t.dtype}/{t.data.shape}/".encode())
        h.update(t.data.tobytes())
    return h.digest()


def _mode(msg: Message) -> str:
    return msg.meta.get("mode", "train")


class Flow:
    """The step's work at stage ``core.stage`` (module docstring)."""

    def __init__(self, core: Core) -> None:
        self.c = core
        s = core.s
        self.actions = stage_actions(s.stage, s.num_stages, s.M, in_flight=s.max_in_flight)
        """A chain: this stage's actions of every training step (the in-process driver's list too)."""
        self._later_readies: list[tuple[Message, str]] = []
        """ROUTE ``ready`` of later steps (or run epochs) than the one served, kept for it."""

    # ------------------------------------------------------------------ links
    def live(self, name: str | None) -> bool:
        link = self.c.links.named(name) if name is not None else None
        return link is not None and link.welcomed and link.contact not in self.c.members.gone

    def up_links(self) -> list[str]:
        return [link.name for link in self.c.links.of_stage(self.c.links.up) if self.live(link.name)]

    def down_links(self) -> list[str]:
        """The downstream links, in contact order (every replica of a stage orders them alike)."""
        links = [link for link in self.c.links.of_stage(self.c.links.down) if self.live(link.name)]
        return [link.name for link in sorted(links, key=lambda link: link.contact or link.name)]

    @property
    def contact(self) -> str:
        """This peer's own contact (what its neighbours' links name it by)."""
        return next((link.local_contact for link in self.c.links if link.local_contact), "")

    def bye_from_up(self, msg: Message) -> bool:
        """A BYE from upstream (the run ends, or an upstream replica leaves)."""
        return msg.type is MT.BYE and msg.src == self.c.links.up

    def several(self, stage: int | None) -> bool:
        """The run may route micro-batches of ``stage`` through another of its replicas."""
        return len(self.c.links.of_stage(stage)) > 1

    # ------------------------------------------------------------------ the start of a step
    def new_step(self, step: int) -> StepState:
        c = self.c
        return StepState(step, frozenset(link.name for link in c.links if self.live(link.name)),
                         gone_before=frozenset(c.members.gone))

    def start(self, cur: StepState) -> bool:
        """Begin serving ``cur``: stage 0's share, a receiver's ``ready``s (after the step's PROJ);
        False while the PROJ is awaited (the caller waits for it)."""
        c = self.c
        if cur.started:  # serving it again after a reopen
            return True
        if c.first:
            if c.s.replicas and c.joined != cur.step:  # a joiner gets a share once its round ranked it
                cur.todo = [g - cur.step * c.s.M for g in replica_share(cur.step, c.s.M, c.members.rank,
                                                                         c.members.count)]
        elif c.joined != cur.step:  # a joining replica takes no ACTs before its first round
            if c.proj.takes and c.projector_step < cur.step:
                return False
            for name in self.up_links():
                if c.s.replicas:
                    c.send(do.SendRoute(name, cur.step, "ready"))
                else:  # a chain's link is ready for every step and carries all M ACTs
                    cur.announced[name] = c.s.M
                cur.readied.add(name)
        if not c.s.replicas and not c.last:
            cur.ready = self.down_links()
        cur.started = True
        self.take_later_readies(cur)
        return True

    # ------------------------------------------------------------------ what comes next
    def next(self, cur: StepState, now: float) -> do.Intent | None:
        """The next work of the step, None when the step is done here (or the caller looks again)."""
        c = self.c
        repair = c.repair
        if cur.repair_by and now > cur.repair_by and (cur.held or cur.rerun & cur.dest.keys()
                                                      or cur.awaited and not repair.upstream_answered(cur, cur.awaited)):
            c.redo.issue(cur.step, f"the repair after a replica left did not come within {c.s.timeout_s / 2:g} s "
                                   f"({len(cur.held)} re-run(s) awaited here, {len(cur.rerun & cur.dest.keys())} "
                                   f"GRAD(s) of ACTs sent again)")
            return None
        if cur.notices or cur.reopen or cur.resend:
            repair.reopen(cur)
            return None
        if cur.waiting and cur.ready:
            self.send_waiting(cur, now)
            if c.queued() or c.redo_due:
                return None
        if not c.last and not cur.ended and self.all_computed(cur) and not cur.waiting:
            cur.ended = True
            if c.s.replicas:
                for name in cur.ready:
                    c.send(do.SendRoute(name, cur.step, "end", acts=cur.sent[name]))
            return None
        if self.done(cur):
            # a reopen queued meanwhile comes after its link's end: the step is not done here yet
            got = c.inbox.take_from(lambda m: m.type is MT.ROUTE and m.meta["phase"] == "reopen"
                                    and (m.step, m.epoch) == (cur.step, c.epoch))
            if got is not None:
                self.handle(got[0], got[1].name, cur)
                return None
            self.end_queued_readies(cur)
            return SERVED
        return self._ordered(cur) if not c.s.replicas else self._greedy(cur)

    def _greedy(self, cur: StepState) -> do.Intent | None:
        c = self.c
        if c.first and cur.todo and cur.ready and len(cur.dest) < c.s.max_in_flight * len(cur.ready):
            return self.feed(cur, cur.todo.pop(0))
        # GRADs first (with the grad stream's codebook slices that come before them)
        got = c.inbox.take_from(lambda m: (m.type is MT.GRAD and m.step == cur.step) or (
            m.type is MT.CODEBOOK_SLICE and m.meta.get("stream") == "grad"))
        if got is None:
            got = c.inbox.take_from(lambda m: self.wanted(m, cur.step))
        if got is None:
            return do.Wait(lambda m: self.wanted(m, cur.step), f"ACT, GRAD or ROUTE of step {cur.step}",
                           c.s.timeout_s, self.waited(cur))
        return c.take(got, lambda m, link: self.handle(m, link, cur))

    def _ordered(self, cur: StepState) -> do.Intent | None:
        """A chain: the next action of the 1F1B list, with its own input only: the messages of that
        action's link in arrival order (codebook slices, and upstream the validation's eval ACTs); a
        later micro-batch's waits in the inbox for its turn."""
        c = self.c
        action = self.actions[cur.action]
        micro = action.micro
        if action.op is Op.FORWARD:
            if c.first:
                return self.feed(cur, micro)
            mtype, src = MT.ACT, c.links.up
        else:
            mtype, src = MT.GRAD, c.links.down

        def wanted(m: Message) -> bool:
            if m.type is MT.BYE:
                return m.src == c.links.up
            if m.src != src:
                return False
            if m.type is MT.CODEBOOK_SLICE or m.type is MT.PROJ:
                return True
            if m.type is MT.ACT and _mode(m) == "eval":
                return self.wanted(m, cur.step)
            if m.type is mtype and m.step == cur.step:
                return m.micro == micro or not self.acceptable(m, cur)  # a due later one waits its turn
            return m.type in (MT.ACT, MT.GRAD) and m.step < cur.step

        got = c.inbox.take_from(wanted)
        if got is None:
            return do.Wait(wanted, f"{mtype.name} of step {cur.step} micro-batch {micro}", c.s.timeout_s,
                           [link.name for link in c.links.of_stage(src)])
        return c.take(got, lambda m, link: self.handle(m, link, cur))

    def wanted(self, msg: Message, step: int) -> bool:
        """What the serving of ``step`` takes from the inbox: its ACTs, GRADs, ROUTEs, eval ACTs (their
        projector loaded), codebook slices, the upstream BYE; later steps' messages wait their turn."""
        c = self.c
        if msg.type is MT.CODEBOOK_SLICE:
            return True
        if msg.type is MT.BYE:
            return msg.src == c.links.up
        if msg.type is MT.ACT and _mode(msg) == "eval":
            return msg.step <= step and c.projector.ready(msg.step)
        return msg.type is not MT.PROJ_GRAD and msg.step <= step

    def waited(self, cur: StepState) -> list[str]:
        """The links this replica waits on now (the waiting log names them)."""
        ups = [name for name in self.up_links() if name in cur.readied and name not in cur.announced]
        return ups + list(dict.fromkeys(name for name, _ in cur.dest.values()))

    # ------------------------------------------------------------------ a message of the step
    def handle(self, msg: Message, link: str, cur: StepState) -> do.Intent | None:
        """A message the serving took (its link live, of the current run epoch)."""
        c = self.c
        if msg.type is MT.BYE:
            return c.on_bye(msg, link, during_step=True)
        if msg.type is MT.ROUTE:
            self.on_route(msg, link, cur)
            return None
        if msg.type is MT.ACT and _mode(msg) == "eval":
            return c.validation.eval_act(msg, link)
        if msg.type is MT.PROJ:
            c.projector.copy(msg)
            return None
        if msg.step < cur.step:  # a stale message of a neighbour (a replica's copy a step late)
            log.debug("%s: %s of step %d from %s not used (step %d)", c.s.name, msg.type.name, msg.step, link,
                      cur.step)
            return None
        if msg.type is MT.ACT:
            return self.on_act(msg, link, cur)
        if msg.type is MT.GRAD:
            return self.on_grad(msg, link, cur)
        c.drop("out_of_window", msg, "one step at a time", f"{msg.type.name} while at step {cur.step}")
        return None

    def acceptable(self, msg: Message, cur: StepState) -> bool:
        """A chain: whether a train ACT or GRAD of the step may be taken now or later (else it is
        dropped as soon as it is seen)."""
        links = self.c.links.of_stage(msg.src)
        if msg.type is MT.ACT:
            return bool(links) and self._act_problem(msg, links[0].name, cur) is None
        went = cur.dest.get(msg.micro)
        return went is not None and msg.pver == self.c.proj.outbound_pver

    def _act_problem(self, msg: Message, link: str, cur: StepState) -> tuple[str, str, str] | None:
        c, micro = self.c, msg.micro
        if link not in cur.readied or link in cur.announced and cur.received[link] >= cur.announced[link]:
            return "not_allowed", "ACTs only on links told ready, up to their end", f"from {link}"
        if not 0 <= micro < c.s.M or (micro in cur.origin and micro not in cur.held):
            return "out_of_window", "one ACT per micro-batch of the step", f"micro-batch {micro} of {c.s.M} " \
                                                                           f"(taken already?)"
        if msg.pver != c.proj.inbound_pver:
            return "stale_projector", "ACTs use the projector this stage holds", \
                f"made with projector v{msg.pver}, this stage holds v{c.proj.inbound_pver}"
        return None

    def on_act(self, msg: Message, link: str, cur: StepState) -> do.Intent | None:
        c = self.c
        problem = self._act_problem(msg, link, cur)
        if problem is not None:
            c.drop(problem[0], msg, problem[1], problem[2])
            return None
        if msg.micro in cur.held:
            c.repair.take_rerun(msg, link, cur)
            return None
        cur.origin[msg.micro] = link
        return do.Forward(c.token, msg, link)

    def on_grad(self, msg: Message, link: str, cur: StepState) -> do.Intent | None:
        c, micro = self.c, msg.micro
        if micro in cur.replayed:  # sent again for the next stage's sake: this stage counts it already
            log.debug("%s: GRAD of micro-batch %d of step %d (a replay) not used", c.s.name, micro, cur.step)
            return None
        went = cur.dest.get(micro)
        if went is None or went[0] != link:
            c.drop("out_of_window", msg, "a GRAD answers a train ACT sent on its link",
                   f"no GRAD of micro-batch {micro} due from {link}")
            return None
        if msg.pver != c.proj.outbound_pver:
            c.drop("stale_projector", msg, "GRADs come from ACTs of the projector this stage holds",
                   f"made with projector v{msg.pver}, this stage holds v{c.proj.outbound_pver}")
            return None
        origin = cur.origin.get(micro)
        return do.Backward(c.token, micro, msg, link, origin if c.s.replicas else None)

    def on_route(self, msg: Message, link: str, cur: StepState) -> None:
        """ROUTE ``ready`` (from downstream), ``end`` or ``reopen`` (from upstream, in the link's order)."""
        c = self.c
        phase = msg.meta["phase"]
        if phase == "ready":
            if msg.step == cur.step and not cur.ended and link not in cur.ready:
                cur.ready.append(link)
                cur.ready.sort(key=lambda name: c.links.named(name).contact or name)
            else:  # too late to be routed to: nothing of the step comes on it
                self._too_late(msg, link, cur)
            return
        if phase == "reopen":
            c.repair.on_reopen(msg, link, cur)
            return
        if msg.step < cur.step:  # a fresh end after a reopen that came once this stage's round was whole
            log.debug("%s: ROUTE end of step %d from %s not used (step %d)", c.s.name, msg.step, link, cur.step)
            return
        if link not in cur.readied or link in cur.announced or msg.step != cur.step \
                or msg.meta["acts"] < cur.received[link]:
            c.drop("out_of_window", msg, "one ROUTE end per ready link and step, after its ACTs' count",
                   f"from {link} (ACTs taken {cur.received[link]})")
            return
        cur.announced[link] = int(msg.meta["acts"])

    # ------------------------------------------------------------------ forward and backward
    def feed(self, cur: StepState, micro: int) -> do.Intent:
        if not self.c.s.replicas:
            cur.action += 1
        return do.Feed(self.c.token, micro)

    def forwarded(self, intent: do.Feed | do.Forward, payload: Any, loss: Any = None, tokens: int = 0) -> None:
        """The forward ``intent`` asked for (stage 0's data, or a received ACT) gave ``payload`` (None on
        the last stage, which keeps ``loss``)."""
        c, cur = self.c, self.c.cur
        if isinstance(intent, do.Forward):
            msg, link = intent.msg, intent.link
            micro = msg.micro
            cur.received[link] += 1
            if self.several(c.links.up):
                cur.digests[micro] = act_digest(msg)
            if not c.s.replicas:
                cur.action += 1
        else:
            micro, link = intent.micro, None
        cur.forwarded += 1
        if payload is not None:
            if not c.s.replicas:  # its one downstream link, in the order of the actions
                self._send_act(cur, micro, payload, cur.ready[0])
            else:
                cur.waiting.append((micro, payload))
            return
        cur.losses.append(loss)
        cur.tokens += tokens
        c.send(do.Backward(c.token, micro, None, None, link if c.s.replicas else None))

    def backwarded(self, intent: do.Backward, grad: Any) -> None:
        """The backward ``intent`` asked for (its GRAD from a link; none: the last stage's loss) gave
        ``grad`` (None on stage 0)."""
        c, cur = self.c, self.c.cur
        micro, link = intent.micro, intent.link
        if link is not None:
            went = cur.dest.pop(micro, None)
            if went is not None:
                c.router.returned(link, c.clock() - went[1])
        if not c.s.replicas:
            cur.action += 1
        cur.done.append(micro)
        log.debug("%s: step %d micro-batch %d backward (%d of the step)", c.s.name, cur.step, micro, len(cur.done))
        if grad is None:
            return
        if micro in cur.digests:
            cur.grads[micro] = grad
        origin = cur.origin.get(micro)
        if origin is not None and self.live(origin):
            c.send(do.SendGrad(origin, cur.step, micro, grad, c.proj.inbound_pver))

    def retransmitting(self, intent: do.Forward | do.Backward) -> None:
        """The codes of ``intent``'s ACT or GRAD could not be decoded: dropped, its copy follows on its
        link (asked for by the link)."""
        if isinstance(intent, do.Forward):
            self.c.cur.origin.pop(intent.msg.micro, None)

    # ------------------------------------------------------------------ routing
    def send_waiting(self, cur: StepState, now: float) -> None:
        """The computed ACTs, each on the link the router draws; once a replica of this stage left
        during the step, only after every ready downstream link said which of its micro-batches it
        holds (ROUTE ``gone``), and a held one's re-run on its holder's."""
        c = self.c
        while cur.waiting and cur.ready:
            if cur.partners_gone and not all(cur.partners_gone <= cur.told.get(x, set()) for x in cur.ready):
                if now < cur.repair_by:
                    return  # the notice wakes the schedule
                c.redo.issue(cur.step, f"a downstream replica did not say within {c.s.timeout_s / 2:g} s which "
                                       f"micro-batches of the step it took from this stage's replica that left")
                return
            micro, payload = cur.waiting[0]
            link = cur.hold_at.get(micro)
            if link is None:
                link = c.router.pick(cur.ready, cur.step, micro)
            elif link not in cur.ready:
                return  # its holder's ready has not come yet
            cur.waiting.pop(0)
            self._send_act(cur, micro, payload, link)

    def _send_act(self, cur: StepState, micro: int, payload: Any, link: str) -> None:
        c = self.c
        c.send(do.SendAct(link, cur.step, micro, payload, False, c.proj.outbound_pver))
        cur.sent[link] += 1
        cur.via[micro] = link
        if micro not in cur.replayed:  # a replay's GRAD is not awaited: this stage counts it already
            c.router.sent(link)
            cur.dest[micro] = (link, c.clock())
        if self.several(c.links.down):
            cur.payloads[micro] = payload

    # ------------------------------------------------------------------ ROUTE ready
    def on_ready(self, msg: Message, link: str) -> None:
        """ROUTE ``ready`` from downstream, taken at once: for a step this replica ended, ``end`` with 0
        ACTs (its averaging round may wait, through the stage's other replicas, for this answer); for
        the step it routes now, a link to route to; one of a later step waits for that step."""
        c = self.c
        cur = c.cur
        if msg.epoch < c.epoch:
            return
        if msg.epoch == c.epoch and (msg.step < cur.step or (msg.step == cur.step and cur.ended)):
            self._too_late(msg, link, cur)
            return
        if msg.epoch == c.epoch and msg.step == cur.step:
            self.on_route(msg, link, cur)
            c.wake()
            return
        if len(self._later_readies) >= _LATER_READIES:
            c.reject("queue_full", link, f"{_LATER_READIES} ROUTE ready of later steps wait already")
            return
        self._later_readies.append((msg, link))

    def _too_late(self, msg: Message, link: str, cur: StepState) -> None:
        """A ``ready`` that came once this replica ended its step (or of an earlier one): ``end`` with 0
        ACTs; one of the current step is routed to again if the step reopens (``ready_late``)."""
        self.c.spawn(do.SendRoute(link, msg.step, "end", acts=0))
        if msg.step == cur.step and link not in cur.ready_late:
            cur.ready_late.append(link)

    def take_later_readies(self, cur: StepState) -> None:
        """The ``ready``s of ``cur``'s step (and run epoch) that came before it began."""
        c = self.c
        keep = []
        for msg, link in self._later_readies:
            if msg.epoch < c.epoch or not self.live(link):
                continue  # of an attempt a redo ended, or of a replica gone
            if msg.step == cur.step and msg.epoch == c.epoch:
                self.on_route(msg, link, cur)
            elif msg.step > cur.step or msg.epoch > c.epoch:
                keep.append((msg, link))
            else:
                c.send(do.SendRoute(link, msg.step, "end", acts=0))
        self._later_readies = keep

    def end_queued_readies(self, cur: StepState) -> None:
        """A ``ready`` of the step still kept when the step is done gets its ``end`` with 0 ACTs."""
        c = self.c
        keep = []
        for msg, link in self._later_readies:
            if msg.epoch < c.epoch:
                continue  # of an attempt a redo ended
            if msg.step <= cur.step and msg.epoch == c.epoch:
                c.send(do.SendRoute(link, msg.step, "end", acts=0))
            else:
                keep.append((msg, link))
        self._later_readies = keep

    # ------------------------------------------------------------------ when the step is done here
    def all_computed(self, cur: StepState) -> bool:
        """Every train ACT of the step this stage will compute was computed (of the live upstream
        links: one that left owes nothing more)."""
        c = self.c
        if c.first:
            return not cur.todo and (c.s.replicas or cur.forwarded == c.s.M)
        if cur.awaited and not c.repair.upstream_answered(cur, cur.awaited):
            return False  # what an upstream replica that left had not passed on may come again
        live = set(self.up_links())
        return set(cur.announced) >= cur.readied & live and cur.forwarded == cur.taken \
            and all(cur.received[name] == n for name, n in cur.announced.items() if name in live)

    def done(self, cur: StepState) -> bool:
        """Every micro-batch of the step passed this stage both ways (one that went to a replica that
        left went again), every re-run of one taken from an upstream replica that left came, and
        every ready link had its ``end``."""
        return self.all_computed(cur) and not cur.dest and not cur.waiting and not cur.resend \
            and not cur.notices and not cur.reopen and not cur.held and len(cur.done) == cur.forwarded \
            and (self.c.last or cur.ended)

