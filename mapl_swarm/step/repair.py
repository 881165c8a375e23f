"""Replicas that leave mid-step (SPEC §9.10 item 10): the step is repaired where it can be, else redone.

A neighbour replica that goes silent past its liveness deadline, or says BYE before the end, while
its stage keeps a live replica, is **gone**: its links are dropped (nothing it owed is awaited any
longer) and its stage's other replicas are told (ROUTE ``gone``), which average without it. What
it had accumulated is lost; while its neighbours serve the step (or flush it before their round
is whole: "active") they repair it:

- a sender sends the ACTs that went to it again, with the bytes it kept (ROUTE ``reopen`` naming it
  first on its ready links, :meth:`Repair.forget`, :meth:`Repair.reopen`), and drops the GRAD of one
  it had backwarded;
- its partners route each re-sent ACT to the replica of the next stage that took it from the gone
  one (the ``held`` of that replica's ``gone``), which gives the GRAD it computed again instead of
  computing it (:meth:`Repair.take_rerun`; its gradients count the micro-batch already);
- what the gone replica had not passed on comes as new ACTs, which the next stage waits for
  (:meth:`Repair.answer`: every live upstream replica says ``gone`` or ``reopen`` first; one
  that said so in an earlier step sent nothing of this one to it, so neighbours that find the
  death a step apart still get each other's word).

A replica that flushed already and gets a ``reopen`` before its round is whole serves the step
again. Every micro-batch then counts once per stage and no step is redone. Otherwise (a stage-0
replica gone: its share of the data is read by no one else; a re-run whose bytes differ; a repair
that does not come within half ``net.timeout_s``) the step is redone (:meth:`~.redo.Redo.issue`).
A stage whose last replica leaves is the peer's (the swarm re-forms, or the run ends).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mapl_swarm.step import intents as do
from mapl_swarm.step.flow import act_digest
from mapl_swarm.step.phase import Phase
from mapl_swarm.step.state import StepState
from mapl_swarm.wire import Message, MessageType

if TYPE_CHECKING:
    from mapl_swarm.step.context import Core, LinkView

log = logging.getLogger(__name__)

__all__ = ["Repair"]

MT = MessageType

EARLY_NOTICES = 64
"""ROUTE ``gone`` of a step kept until the step begins here, at most (one per neighbour and gone
replica is what honest neighbours send)."""


MAX_SAID = 1024
"""Contacts kept of what one upstream link said gone, at most (departures over a whole run)."""


class Repair:
    """What replicas that leave change in stage ``core.stage``'s step (module docstring)."""

    def __init__(self, core: Core) -> None:
        self.c = core
        self.said: dict[str, dict[str, int]] = {}
        """Upstream link -> the contacts it said ``gone`` or ``reopen`` of -> the first step it did:
        of one it said so of in an earlier step it sent nothing of a later step to them."""
        self.leaving = False
        """The swarm took this replica for gone and it leaves (:meth:`taken_for_gone`)."""
        self.early: list[tuple[Message, LinkView]] = []
        """ROUTE ``gone`` of the step this replica moved to, come before it began serving it
        (:meth:`began`)."""

    def replica_gone(self, link: LinkView, why: str, *, after: int | None = None) -> bool:
        """Neighbour replica ``link`` left (``why``: silent past its deadline, its BYE): True when its
        stage keeps a live replica (this one goes on without it), False when it was its stage's last
        (the caller's, as any departure: the swarm re-forms or the run ends). ``after``: it left on
        purpose once it took that many steps (BYE ``leave``): it took no work of a later step, so
        nothing is repaired."""
        c = self.c
        flow = c.flow
        if link.contact is None or not link.welcomed:
            return False
        if link.contact in c.members.gone:
            return True
        if not any(flow.live(other.name) for other in c.links.of_stage(link.stage) if other is not link):
            return False
        if after is not None and after >= c.step:
            log.info("%s: the replica of stage %d at %s left after step %d (%s); its stage goes on with its other "
                     "replicas", c.s.name, link.stage, link.contact, after - 1, why)
            self.learn_gone([link.contact])
            return True
        log.warning("%s: the replica of stage %d at %s left (%s); going on with the stage's other replicas",
                    c.s.name, link.stage, link.contact, why)
        cur = c.cur
        active = c.active
        downstream = link.stage == c.links.down
        held = sorted(m for m, came in cur.origin.items() if came == link.name) if cur.step == c.step else []
        self.learn_gone([link.contact])  # what went to it goes again (forget)
        if cur.resend:  # the notice goes before the re-sends, in the step's order (reopen)
            cur.notices.append(link.contact)
            c.wake()
        else:
            for other in c.links.of_stage(link.stage):
                if flow.live(other.name) and other.name not in cur.replayed_to:  # those had a reopen
                    c.spawn(do.SendRoute(other.name, c.step, "gone", gone=(link.contact,),
                                         held=None if downstream else tuple(held), epoch=c.epoch))
        # told too, on its own link: a live one whose messages were held back past this peer's
        # deadline leaves, instead of serving on while the swarm counts none of its work
        c.spawn(do.SendRoute(link.name, c.step, "gone", gone=(link.contact,), epoch=c.epoch, best_effort=True))
        if link.stage == 0:
            if c.phase is Phase.SERVE and cur.step == c.step:
                # its share of the step's data is read by no other replica: stage 0 splits the step
                # again among the replicas left (a redo), before this replica's round
                c.redo.soon(c.step, "the replica of stage 0 that left had its share of the step's micro-batches")
        elif active and not downstream:
            # what it had not passed on comes again through its partners, routed to any ready link
            # (this one too, though its ``end`` came): its partners' word on it is awaited
            cur.awaited.add(link.contact)
            self.deadline(cur)
        if link.stage != 0 and active and held:
            # what it accumulated of them is lost at its stage: their re-runs come through its
            # partners, which route them here (the ``held`` of the notice); this replica gives
            # each the GRAD it computed (its own gradients count them already) and waits for them
            cur.held.update(held)
            cur.held_from.add(link.name)
            self.deadline(cur)
            log.warning("%s: %d train micro-batch(es) of step %d came through it; their re-runs come through its "
                        "stage's other replicas", c.s.name, len(held), cur.step)
            c.redo.serve_again()
        elif link.stage != 0 and held and c.committing:
            # this stage's round is whole: nothing is awaited here, but the gone replica's partners
            # still need the GRADs of what went through it; a re-run that comes is answered with
            # the GRAD kept (take_rerun), and its part of the inbound projector's gradient goes again
            # with the link the re-runs came on once all came (the gone one's PROJ_GRAD died with it)
            cur.held.update(held)
            cur.held_from.add(link.name)
        return True

    def learn_gone(self, contacts: Sequence[str]) -> None:
        """Replicas at ``contacts`` left: their links are dropped (what they owe is no longer
        awaited), a round of this stage waiting for one of them starts again without it."""
        c = self.c
        for contact in c.members.learn_gone(contacts):
            for link in c.links:
                if link.contact == contact:
                    self.forget(link.name)
            if c.members.in_round(contact) or c.members.round is None:  # a round (the sync round) waits for it
                c.members.rerank()
                c.rounds.cancel()
        c.wake()

    def forget(self, name: str) -> None:
        """The current step stops waiting for what link ``name``'s replica owed: its ``end``, its
        GRADs. While this replica is active in the step, every train ACT that went to it is sent
        again (the replica's accumulated gradients died with it), after ROUTE ``reopen`` naming it
        (:meth:`reopen`); the GRAD of one whose backward ran here already is dropped when it comes."""
        c = self.c
        cur = c.cur
        if name in cur.ready:
            cur.ready.remove(name)
        for micro, (to, _) in list(cur.dest.items()):
            if to == name:
                del cur.dest[micro]
        c.router.forget(name)
        for micro, at in list(cur.hold_at.items()):
            if at == name:
                del cur.hold_at[micro]
        c.validation.link_gone(name)
        if not c.active:
            if c.committing and c.commit.awaiting == "reports":
                self.replay(cur, name)
            return
        again = sorted(m for m, to in cur.via.items() if to == name)
        if not again:
            return
        if any(m not in cur.payloads for m in again):  # sent while it was its stage's only replica
            stage = c.links.down if name in {x.name for x in c.links.of_stage(c.links.down)} else c.links.up
            c.redo.soon(cur.step, f"the replica of stage {stage} that left took train micro-batch(es) of the step "
                                  f"this replica kept no copy of")
            return
        self._ready_again(cur)
        cur.replayed.update(m for m in again if m in cur.done)
        cur.rerun.update(m for m in again if m not in cur.done)
        self.deadline(cur)  # what comes back of them (GRADs, PROJ_GRADs) comes in time, or the step is redone
        cur.resend.extend((m, cur.payloads[m]) for m in again)
        cur.untake.add(name)  # its PROJ_GRAD, if added: the re-runs' receivers send those parts
        if cur.ended:
            cur.ended, cur.reopen = False, True
        c.redo.serve_again()
        log.warning("%s: %d train micro-batch(es) of step %d went through the replica at %s: sent again (%d of them "
                    "backwarded here already)", c.s.name, len(again), cur.step, name,
                    sum(m in cur.done for m in again))

    def _ready_again(self, cur: StepState) -> list[str]:
        """The links a reopen routes to: the ready ones, and those whose ``ready`` came after this
        replica's ``end`` (answered with 0 ACTs), live, in contact order (``cur.ready``)."""
        c = self.c
        cur.ready.extend(x for x in cur.ready_late if x not in cur.ready and c.flow.live(x))
        cur.ready_late.clear()
        cur.ready.sort(key=lambda x: c.links.named(x).contact or x)
        return [x for x in cur.ready if c.flow.live(x)]

    def replay(self, cur: StepState, name: str) -> None:
        """Link ``name``'s replica left while this replica's round is whole and nobody took the step
        (its commit waits for the REPORTs): it may have died in its own round, before that was
        whole, after every GRAD and PROJ_GRAD of what went to it came back here. Its partners'
        round can still be made whole: every train ACT of the step that went to it goes again (ROUTE
        ``reopen`` naming it, the ACTs with the bytes kept, a fresh ``end``) to the ready links, and
        nothing of them is awaited back, as this replica's gradients, projector's included, count
        them already (what comes back is dropped quietly, :meth:`replayed_reply`). A partner whose
        round was whole already takes none of it."""
        c = self.c
        link = c.links.named(name)
        again = sorted(m for m, to in cur.via.items() if to == name and m in cur.payloads)
        targets = [x for x in self._ready_again(cur) if x != name]
        if link is None or link.contact is None or not again or not targets:
            return
        by: dict[str, list[int]] = {}
        for m in again:
            held = cur.hold_at.get(m)
            by.setdefault(held if held in targets else c.router.pick(targets, cur.step, m), []).append(m)
        for to, micro in by.items():
            c.spawn(do.SendRoute(to, cur.step, "reopen", gone=(link.contact,), epoch=c.epoch))
            for m in micro:
                c.spawn(do.SendAct(to, cur.step, m, cur.payloads[m], False, c.proj.outbound_pver))
                cur.sent[to] += 1
                cur.via[m] = to
            c.spawn(do.SendRoute(to, cur.step, "end", acts=cur.sent[to], epoch=c.epoch))
        cur.replayed.update(again)
        cur.replayed_to.update(by)
        log.warning("%s: %d train micro-batch(es) of step %d went through the replica at %s, which left before the "
                    "step was taken: sent again for its partners' round (this stage's round counts them already)",
                    c.s.name, len(again), cur.step, name)

    def replayed_reply(self, msg: Message) -> bool:
        """A GRAD of a micro-batch :meth:`replay` sent again, or a PROJ_GRAD once it sent some, of the
        step being committed: this replica counts them already (the commit drops them quietly)."""
        c = self.c
        cur = c.cur
        return (bool(cur.replayed_to) and msg.step == cur.step and msg.epoch == c.epoch
                and ((msg.type is MT.GRAD and msg.micro in cur.replayed) or msg.type is MT.PROJ_GRAD))

    # ------------------------------------------------------------------ what neighbours say
    def names_me(self, msg: Message) -> bool:
        """Whether a ROUTE names this replica's own contact among the gone."""
        own, gone = self.c.flow.contact, msg.meta.get("gone", [])
        return bool(own) and isinstance(gone, list) and own in gone

    def taken_for_gone(self, why: str) -> None:
        """A neighbour said this replica is gone (``why``): its partners and neighbours follow that word
        and count none of its work from now on, so it leaves (:class:`~.intents.Leave`), once."""
        c = self.c
        if c.s.replicas and not self.leaving:
            self.leaving = True
            log.warning("%s: the swarm took this replica for gone (%s): it leaves, and its stage goes on with its "
                        "other replicas", c.s.name, why)
            c.spawn(do.Leave(why))

    def named(self, msg: Message) -> list[str]:
        """The contacts a ROUTE names gone, but this replica's own and its links' (of its own links its
        liveness deadline and their BYEs decide)."""
        c = self.c
        own = {x.contact for x in c.links if x.contact} | {c.flow.contact}
        return c.members.named(msg.meta.get("gone", []), own)

    def on_route(self, msg: Message, link: LinkView) -> None:
        """ROUTE ``gone`` or ``redo``: the replicas it names left (taken for those this replica has no
        link to); ``gone`` of the current step also says which of its micro-batches the sender holds.
        One that names this replica: the swarm took it for gone, so it leaves (:meth:`taken_for_gone`)."""
        c = self.c
        if self.names_me(msg):
            self.taken_for_gone(f"stage {link.stage}'s {link.contact or link.name} named it gone in ROUTE "
                                f"{msg.meta['phase']} of step {msg.step}")
            return
        contacts = self.named(msg)
        if link.stage == c.links.up:
            self.say(link.name, msg)
        if msg.meta["phase"] == "gone" and (msg.step, msg.epoch) == (c.step, c.epoch):
            if c.cur.step == msg.step:
                self.on_gone(msg, link, contacts)
            elif len(self.early) < EARLY_NOTICES:  # the step's state is made at its boundary: it counts then
                self.early.append((msg, link))
        self.learn_gone(contacts)

    def said_gone(self, msg: Message, link: str) -> None:
        """A ``reopen`` from upstream link ``link`` arrived: the replicas it names left (this stage's
        rounds stop waiting for them at once), and that link said so (:attr:`said`)."""
        self.say(link, msg)
        self.learn_gone(self.named(msg))

    def began(self, cur: StepState) -> None:
        """The state of the current step was made: the ROUTE ``gone`` of it that came before count now
        (a neighbour that asks for this replica's word on a partner it knew gone gets it)."""
        c = self.c
        early, self.early = self.early, []
        for msg, link in early:
            if (msg.step, msg.epoch) == (cur.step, c.epoch) and c.links.named(link.name) is not None:
                self.on_gone(msg, link, self.named(msg))

    def on_gone(self, msg: Message, link: LinkView, contacts: list[str]) -> None:
        """ROUTE ``gone`` or ``reopen`` of the current step: a neighbour names replicas of this stage
        that left (it sends the notice to the gone replica's partners only; an upstream one says
        ``reopen`` instead when what went to them comes here again after its ``end``). One from
        downstream also says which of the step's micro-batches it took from them (``held``): their
        re-runs, which come here or to another partner, go to it. Until every ready downstream link
        said so of every partner gone, this replica routes no ACT (:meth:`~.flow.Flow.send_waiting`)."""
        c = self.c
        cur = c.cur
        if link.stage == c.links.up:
            cur.answered.setdefault(link.name, set()).update(self.word_of(msg))
        fresh = [x for x in contacts if x not in cur.gone_before]  # not gone when this attempt began
        if fresh:
            self.deadline(cur)
        cur.partners_gone.update(fresh)
        if link.stage == c.links.down:  # it waits for this replica's word on them, fresh or not
            cur.asked.update(contacts)
        if fresh and link.stage == c.links.down:
            cur.told.setdefault(link.name, set()).update(fresh)
            held = msg.meta.get("held", [])
            for m in held[:c.s.M] if isinstance(held, list) else ():
                if type(m) is int and 0 <= m < c.s.M:
                    cur.hold_at[m] = link.name
        self.answer(cur)
        c.wake()

    def on_reopen(self, msg: Message, link: str, cur: StepState) -> None:
        """ROUTE ``reopen`` from upstream, in the link's order: more ACTs, then a fresh ``end``, follow."""
        c = self.c
        if msg.step != cur.step or msg.epoch != c.epoch:
            return
        cur.announced.pop(link, None)
        if cur.ended and not c.last:  # what comes now goes on: this stage's links reopen too
            cur.ended, cur.reopen = False, True
        contacts = self.named(msg)
        self.on_gone(msg, c.links.named(link), contacts)
        self.learn_gone(contacts)  # this stage's replicas that left: its rounds go on without them
        c.redo.resume_if_flushing()

    def answer(self, cur: StepState) -> None:
        """Once every live upstream replica said whether what went through this stage's replicas that
        left comes again (``gone`` or ``reopen``), say so downstream: ROUTE ``gone`` naming them. A
        downstream replica that found one of them gone while active waits for this from every live
        upstream replica before it counts its ACTs of the step as all in. While a ``reopen`` is to be
        passed on, the word goes in it (:meth:`reopen`): a ``gone`` ahead of it would let a ready
        link take the ACTs it has as all in before the ``reopen`` says more come."""
        if cur.reopen and self.c.active:
            return
        word = self._word(cur)
        for name in self.c.flow.down_links() if word else ():
            self.c.spawn(do.SendRoute(name, cur.step, "gone", gone=word, epoch=self.c.epoch))

    def _word(self, cur: StepState) -> tuple[str, ...]:
        """The partners gone (or asked about) that every live upstream replica said its word on and
        this replica has not yet said its own on downstream (marked said)."""
        c = self.c
        due = sorted((cur.partners_gone | cur.asked) - cur.answered_down)
        if not due or c.last or not self.upstream_answered(cur, due):
            return ()
        cur.answered_down.update(due)
        return tuple(due)

    def reopen_wanted(self, msg: Message) -> bool:
        """A ROUTE ``reopen`` of the current step and run epoch."""
        c = self.c
        return msg.type is MT.ROUTE and msg.meta.get("phase") == "reopen" and (msg.step, msg.epoch) == (c.step, c.epoch)

    def reopen_queued(self) -> bool:
        """A ROUTE ``reopen`` of the current step waits in the inbox."""
        return self.c.inbox.has(self.reopen_wanted)

    def word_of(self, msg: Message) -> list[str]:
        """The contacts a ROUTE ``gone`` or ``reopen`` from upstream is its sender's word on (bounded),
        this replica's own links' too: a receiver awaits its partners' word on an upstream replica
        it lost itself."""
        return self.c.members.named(msg.meta.get("gone", []), set())

    def say(self, link: str, msg: Message) -> None:
        """Upstream link ``link`` said ``gone`` or ``reopen`` in step ``msg.step`` (:meth:`word_of`)."""
        said = self.said.setdefault(link, {})
        for contact in self.word_of(msg):
            if len(said) < MAX_SAID or contact in said:
                said[contact] = min(said.get(contact, msg.step), msg.step)

    def upstream_answered(self, cur: StepState, contacts: Iterable[str]) -> bool:
        """Every live upstream link said ``gone`` or ``reopen`` of every one of ``contacts``: in the
        step, in the link's order (:meth:`on_gone`), or in an earlier step (then it knew them gone
        before it began this one, and sent them nothing of it)."""
        wanted = set(contacts)
        for name in self.c.flow.up_links():
            earlier = self.said.get(name, {})
            if not all(x in cur.answered.get(name, ()) or earlier.get(x, cur.step) < cur.step for x in wanted):
                return False
        return True

    def deadline(self, cur: StepState) -> None:
        """The repair this replica waits for (re-runs of what it holds, its upstream links' word, its
        downstream links' ``held``) comes within half ``net.timeout_s`` of the first loss of the step
        it learned of, else the step is redone."""
        if not cur.repair_by:
            cur.repair_by = self.c.clock() + self.c.s.timeout_s / 2

    # ------------------------------------------------------------------ the work of the repair
    def reopen(self, cur: StepState) -> None:
        """After a downstream replica left (:meth:`forget`): ROUTE ``reopen`` naming it on the ready
        links (``gone`` on the others), then the ACTs it took go again, in that order on every link (a
        partner knows its partner's loss, and takes ACTs after its ``end``, before the re-sends reach
        it). A replica told ``reopen`` that had said its own ``end`` says ``reopen`` (naming no one)
        on its ready links too."""
        c = self.c
        notices, cur.notices = tuple(cur.notices), []
        relay, cur.reopen = cur.reopen, False
        said = notices + self._word(cur)  # this replica's word on its partners gone goes with it (answer)
        for name in c.flow.down_links():
            if name in cur.ready and (relay or notices):
                cur.reopened.add(name)
                c.send(do.SendRoute(name, cur.step, "reopen", gone=said))
            elif said:
                c.send(do.SendRoute(name, cur.step, "gone", gone=said))
        cur.waiting.extend(cur.resend)
        cur.resend.clear()

    def rerun_wanted(self, msg: Message) -> bool:
        """A train ACT of the step re-running a micro-batch this replica took from an upstream replica
        that left (its round whole: answered with the GRAD it kept, :meth:`rerun_after_whole`)."""
        c = self.c
        return msg.type is MT.ACT and msg.meta.get("mode", "train") == "train" and msg.micro in c.cur.held \
            and (msg.step, msg.epoch) == (c.cur.step, c.epoch)

    def rerun_after_whole(self, msg: Message, link: str) -> None:
        """A re-run that came once this stage's round was whole: the GRAD kept goes back, and once every
        re-run came, the gone link's part of the inbound projector's gradient with the live link's."""
        c = self.c
        self.take_rerun(msg, link, c.cur)
        if not c.cur.held and c.proj.takes:
            c.projector.send_grads(c.cur)

    def take_rerun(self, msg: Message, link: str, cur: StepState) -> None:
        """The re-run of train micro-batch ``msg.micro``, taken here from an upstream replica that
        left: this replica's gradients count it already (its parameters' part, the inbound
        projector's part kept for the gone link), so it is not computed again; it comes from ``link``
        now, whose replica gets the GRAD computed for it (now, or when its backward runs). The re-run
        must bring the ACT the gone replica sent (its partners hold the same parameters and got the
        same input): one that differs redoes the step."""
        c = self.c
        micro = msg.micro
        if act_digest(msg) != cur.digests.get(micro):
            c.redo.issue(cur.step, f"the re-run of train micro-batch {micro} from {link} is not the ACT the "
                                   f"replica that left sent")
            return
        gone = cur.origin[micro]
        cur.received[gone] -= 1
        cur.received[link] += 1
        cur.origin[micro] = link
        cur.held.discard(micro)
        log.debug("%s: step %d micro-batch %d re-run from %s: its GRAD %s", c.s.name, cur.step, micro, link,
                  "given again" if micro in cur.grads else "goes there")
        if micro in cur.grads:
            c.send(do.SendGrad(link, cur.step, micro, cur.grads[micro], c.proj.inbound_pver))
