"""What an admitted message does at a peer: a table of handlers by control type, the rest to the schedule.

:class:`Control` is given the parts its handlers act on (links, linker, liveness monitor, schedule,
checkpoint agreement, the ingress's answers) and reads or asks only a few things of its peer's
session (:class:`~.lifecycle.Lifecycle`: its stage and run epoch, whether it trains, stop, pause, depart).

A HELLO is welcomed (or, from a neighbour re-forming the swarm while this peer trains, pauses it;
SPEC §9.6). WELCOME and REJECT answer this peer's HELLOs (SPEC §9.2: ``stage_taken`` and a configuration
refusal by a peer that is not anchored are retried, any other ends that record's HELLOs, and the
session once every record of the stage refused it). ERROR is informational (logged,
counted in ``errors``) except ``retransmit_unavailable``; BYE ``"rejoin"`` pauses the peer (the
swarm re-forms); during the handshake any other BYE frees the neighbour's stage for another peer;
after it, one from upstream ends the run (the schedule's), from downstream it is a departure (SPEC
§9.5). RESYNC goes to the link's codebooks, REPORT and ROUTE ``ready`` to the schedule (a ROUTE
in a chain never gets this far: the admission refuses it), CHECKPOINT to
the checkpoint agreement (ACT, GRAD, PROJ, PROJ_GRAD, CODEBOOK_SLICE and the upstream BYE that ends
the run never come here: the schedule takes them from the inbound queue). A fresh peer that meets
a swarm re-forming after a departure stops at once, saying that it must resume.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from mapl_swarm.errors import MaplError
from mapl_swarm.net.identity import CertificateError
from mapl_swarm.wire import Message, MessageType
from mapl_swarm.wire.spec import DRAIN_PHASES, DRAIN_REASON, LEAVE_REASON, REJOIN_REASON
from mapl_swarm.peer.link import CONFIG_REFUSALS, stage_name
from mapl_swarm.peer.credits import Credits

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig
    from mapl_swarm.net.heartbeat import HeartbeatMonitor
    from mapl_swarm.net.transport import Membership
    from mapl_swarm.peer.admission import Admitted, Arrival, RejectCounter
    from mapl_swarm.peer.checkpoints import CheckpointAgreement
    from mapl_swarm.peer.replica_resume import ReplicaResume
    from mapl_swarm.peer.ingress import Ingress
    from mapl_swarm.peer.lifecycle import Lifecycle
    from mapl_swarm.peer.link import Links, PeerLink
    from mapl_swarm.peer.linker import Linker
    from mapl_swarm.peer.result import PeerResult
    from mapl_swarm.peer.driver import Schedule

log = logging.getLogger(__name__)

__all__ = ["Control", "PeerRejected"]

MT = MessageType
REDOS_KEPT = 64
"""Recent redos whose makers a peer remembers (a redo's copies arrive within its step)."""


class PeerRejected(MaplError):
    """A neighbour refused the handshake (version or configuration mismatch)."""


class Control:
    """The handlers of a peer's admitted control messages, by type (see the module docstring):
    ``peer`` is its session (:class:`~.lifecycle.Lifecycle`), the rest the parts the handlers act on;
    ``replica_resume()`` the resume agreement of a replica (None without one)."""

    def __init__(self, peer: Lifecycle, cfg: TrainConfig, *, links: Links, linker: Linker, monitor: HeartbeatMonitor,
                 schedule: Schedule, agreement: CheckpointAgreement, ingress: Callable[[], Ingress],
                 rejects: RejectCounter, result: PeerResult, clock: Callable[[], float],
                 replica_resume: Callable[[], ReplicaResume | None], credits: Credits,
                 step: Callable[[], int]) -> None:
        self.peer, self.cfg, self.links, self.linker, self.monitor = peer, cfg, links, linker, monitor
        self.schedule, self.agreement, self.ingress, self.rejects = schedule, agreement, ingress, rejects
        self.result, self.clock, self.replica_resume = result, clock, replica_resume
        self.credits, self.step = credits, step
        """Each member's credit of re-forms and redos (:mod:`~.credits`, the process's), and this session's step."""
        self._exclusions: dict[str, set[str]] = {}
        """Each named replica's contact -> the links of its stage that said ROUTE ``exclude`` of it."""
        self._redo_makers: dict[tuple[int, int], list[str]] = {}
        """(step, run epoch) of each recent redo -> the members that decided it (:meth:`_corroborate`)."""
        self.replicas = cfg.replicas.enabled
        self._handlers: dict[MessageType, Callable[[Message, PeerLink], Awaitable[None]]] = {
            MT.WELCOME: self._on_welcome, MT.REJECT: self._on_reject, MT.ERROR: self._on_error, MT.BYE: self._on_bye,
            MT.RESYNC: self._on_resync, MT.CHECKPOINT: self._on_checkpoint,
            # REPORT and ROUTE ready/commit/taken/gone/redo are the step core's (SPEC §9.10; ROUTE end
            # and reopen come in their link's order through the schedule's queue)
            MT.REPORT: schedule.on_control, MT.ROUTE: self._on_route,
        }

    async def handle(self, got: Admitted, arrival: Arrival, transport: Any) -> None:
        msg = got.msg
        if msg.type is MT.HELLO:
            await self._on_hello(got, arrival, transport)
            return
        await self._handlers[msg.type](msg, got.link)

    async def _on_hello(self, got: Admitted, arrival: Arrival, transport: Any) -> None:
        peer, msg, ingress = self.peer, got.msg, self.ingress()
        if peer.started and msg.epoch > peer.epoch:
            # a neighbour re-forms the swarm (it lost its other neighbour); not answered: it repeats
            # its HELLO to this peer's next session
            if not self._implausible_reform(msg, epoch=msg.epoch, lost=None) and self._has_credit(got.link, msg):
                peer.pause(f"stage {msg.src} re-forms the swarm (its HELLO of run epoch {msg.epoch})",
                           epoch=msg.epoch, lost=None, told_by=msg.src)
            return
        if self._must_resume(msg):
            return
        reply = ingress.reply(transport, arrival, got.link)
        await ingress.answer(got.link.on_hello(msg, arrival.sender, reply, now=self.clock(),
                                               anchored=self.links.anchored))

    def _implausible_reform(self, msg: Message, *, epoch: int | None, lost: int | None) -> bool:
        """Drop (``implausible``, SPEC §7.2 item 9) a neighbour's word that the swarm re-forms unless
        it can be true. A HELLO of a greater run epoch while training: that epoch is this swarm's
        next one. BYE ``"rejoin"``: a stage sees only its own neighbours leave, so the departed stage
        (``lost``) is this peer (the teller lost it, one-sided) or lies beyond the teller, away from
        this peer; unnamed, the teller has a neighbour there. True when dropped."""
        peer, src = self.peer, msg.src
        away = src - peer.stage  # +1: the teller is downstream, -1: upstream
        why = None
        if epoch is not None and epoch != peer.epoch + 1:
            why = f"run epoch {epoch}, but this swarm's next one is {peer.epoch + 1}"
        elif epoch is None and lost is None and not 0 <= src + away < self.cfg.pipeline.num_stages:
            why = f"stage {src} has no other neighbour than this peer, which it is in session with"
        elif lost is not None and not (isinstance(lost, int) and 0 <= lost < self.cfg.pipeline.num_stages
                                       and (lost == peer.stage or (lost - src) * away > 0)):
            why = f"stage {lost!r} is neither this peer nor beyond stage {src}, so stage {src} did not see it leave"
        if why is not None:
            self.rejects("implausible", stage_name(src), f"{msg.type.name}: stage {src} re-forms the swarm: {why}")
        return why is not None

    def _has_credit(self, link: PeerLink, msg: Message) -> bool:
        """A plausible word that the swarm re-forms, from a member with re-forms' credit left
        (:mod:`~.credits`); one without is dropped (``implausible``) and the member excluded."""
        cert = link.peer_certificate
        member = f"the member of certificate serial {cert.serial}" if cert is not None else f"stage {link.stage}"
        return self._spend("reforms", member, msg, link, "made the swarm re-form", "SPEC §7.2 item 11")

    def _spend(self, kind: str, member: str, msg: Message, link: PeerLink, did: str, where: str, *,
               own: bool = True) -> bool:
        """``member`` spends one of its ``kind`` credit (:mod:`~.credits`); without one left its word
        ``msg`` (come on ``link``) is dropped (``implausible``), and ``link`` excluded when ``own``
        (the member is that neighbour, not one passing its word on)."""
        self.credits.reached(self.step())
        credit = getattr(self.credits, kind)
        if credit.spend(member):
            return True
        why = f"{member} {did} {credit.burst} times and again before the swarm regained that many steps ({where})"
        self.rejects("implausible", link.name, f"{msg.type.name}: {why}")
        if own:
            self.peer.exclude(link, why)
        return False

    async def _on_route(self, msg: Message, link: PeerLink) -> None:
        """A ROUTE of the dispatcher's goes to the schedule; a ``redo`` only when, in a certified
        run, its maker signed it, and one the schedule would carry out only when its maker has redos'
        credit left (SPEC §9.10 item 10): passed on by every stage, it costs the whole swarm the step."""
        identity = link.settings.identity
        if msg.meta.get("phase") == "exclude":
            self._on_exclude(msg, link)
            return
        if msg.meta.get("phase") == "redo" and identity is not None:
            try:
                maker = identity.verify_redo(dict(msg.meta), epoch=msg.epoch, step=msg.step)
            except CertificateError as exc:
                self.rejects("not_allowed", link.name, f"ROUTE redo its maker did not sign ({exc.code}: {exc})")
                return
            member = f"the member of certificate serial {maker.serial}"
            own = link.peer_certificate is not None and link.peer_certificate.serial == maker.serial
            if self.schedule.core.redo.news(msg) and not self._spend(
                    "redos", member, msg, link, "made a step be redone", "SPEC §9.10 item 10", own=own):
                return
            self._corroborate((msg.step, msg.epoch), member)
        await self.schedule.on_control(msg, link)

    def _on_exclude(self, msg: Message, link: PeerLink) -> None:
        """ROUTE ``exclude`` (SPEC §9.10 item 15): the rounds of ``link``'s stage found the work of the
        replicas it names wrong, and ``link``'s replica is among those that found so. A named
        replica is cut off and refused (as its certificate were revoked) once more than half of this
        peer's live links to that stage said so: one dishonest replica cannot have a partner cut
        off, and the word of a stage's majority needs no proof a neighbour could check."""
        live = [other for other in self.links.of_stage(link.stage) if other.welcomed]
        for contact in msg.meta["gone"]:
            target = self.links.by_contact(link.stage, contact) if self.peer.started else None
            if target is None or target is link or target not in live:
                self.rejects("implausible", link.name, f"ROUTE exclude naming {contact!r:.80}, which is "
                             f"{'the sender itself' if target is link else 'no live partner of the sender here'}")
                continue
            votes = self._exclusions.setdefault(contact, set())
            votes.add(link.name)
            log.warning("%s: %s says its stage's replicas found the work of %s wrong (%d of the %d live replicas of "
                        "stage %d say so)", self.peer.name, link.name, target.name, len(votes), len(live), link.stage)
            if 2 * len(votes) > len(live):
                cert = target.peer_certificate
                self.peer.exclude(target, f"{len(votes)} of the {len(live)} replicas of stage {link.stage} found its "
                                          f"work wrong (SPEC §9.10 item 15)"
                                          + (f"; revoke certificate serial {cert.serial}" if cert is not None else ""))

    def _corroborate(self, redo: tuple[int, int], member: str) -> None:
        """``member`` decided the redo ``redo`` (step, run epoch) too. Replicas of a stage that read
        the same round decide the same redo, each signing its own: a redo two members decided is
        not one member's word, and each of its makers gets its credit back (a member that lied in
        a round would otherwise spend its honest partners' credit)."""
        makers = self._redo_makers.setdefault(redo, [])
        if member in makers:
            return
        makers.append(member)
        for m in (makers if len(makers) == 2 else [member] if len(makers) > 2 else []):
            self.credits.redos.refund(m)
        while len(self._redo_makers) > REDOS_KEPT:
            self._redo_makers.pop(next(iter(self._redo_makers)))

    def _must_resume(self, msg: Message) -> bool:
        """A HELLO or WELCOME from a swarm that re-forms after a departure (run epoch > 0) while this
        peer starts fresh: it can only take the departed stage's place from that stage's checkpoints,
        so it stops at once saying how (rather than waiting for pipeline messages that never come).
        With replicas a run epoch > 0 is a step's redo or a resumed run's: a joining replica takes
        the epoch with its downloaded state (SPEC §9.10 item 11), a fresh starting one stops."""
        peer = self.peer
        if peer.started or peer.resuming or peer.joining or msg.epoch == 0:
            return False
        if self.replicas:
            peer.stop(PeerRejected(
                f"stage {msg.src} belongs to a swarm that trains already or resumes (run epoch {msg.epoch}): start "
                f"this replica of stage {peer.stage} with --join to take a live replica's state, or with --resume "
                f"when every replica of the run resumes"))
            return True
        peer.stop(PeerRejected(
            f"stage {msg.src} belongs to a swarm that re-forms after a departure (run epoch {msg.epoch}): stage "
            f"{peer.stage} must take the departed peer's place from its checkpoints, so start it again with --resume "
            f"on a host holding stage {peer.stage}'s checkpoint folder ({self.cfg.run.out_dir}/checkpoints)"))
        return True

    async def _on_welcome(self, msg: Message, link: PeerLink) -> None:
        peer = self.peer
        if self._must_resume(msg):
            link.on_welcome(msg)  # the neighbour holds this peer's session: the BYE on stopping ends it
            return
        refused = link.settings.mismatch(msg.meta, msg.src)
        if refused is not None:  # the neighbour runs another configuration (SPEC §9.2 step 3)
            link.on_welcome(msg)  # its session of this peer is open: the BYE on stopping ends it
            peer.stop(PeerRejected(f"stage {msg.src} welcomed stage {peer.stage} with another configuration: "
                                   f"{refused[1]}"))
            return
        link.on_welcome(msg)
        if peer.joining and not peer.started and msg.epoch > link.epoch:
            # a joining replica speaks each neighbour's run epoch on its link (a re-formed swarm's
            # floor is above 0) until its state download brings the epoch it trains in (SPEC §9.10
            # item 11); its HELLOs on the other links keep theirs: a started replica takes a HELLO
            # of a later epoch for a swarm that re-forms
            link.epoch = msg.epoch
        self.monitor.watch(link.name)  # heartbeats to it from now on
        self.linker.welcomed()
        if peer.started:  # a replica linked while training: what it missed
            await self.schedule.on_linked(link)

    async def _on_reject(self, msg: Message, link: PeerLink) -> None:
        peer = self.peer
        link.on_reject(msg)
        reason, retry_s = msg.meta.get("reason"), self.cfg.net.hello_retry_s
        if link.retry and msg.meta.get("code") == "stage_taken":  # its old session has not timed out yet
            log.info("%s: stage %d still holds a session of stage %d; HELLO again in %g s", peer.name, msg.src,
                     peer.stage, retry_s)
            return
        if link.retry:  # a configuration refusal by a peer that is not anchored: which one is wrong is open
            if link.refused_by != reason:
                link.refused_by = reason
                log.warning("%s: stage %d at %s refused this peer: %s; neither is known to hold stage 0's "
                            "configuration yet, so this peer waits for one that does (HELLO again every %g s)",
                            peer.name, msg.src, link.endpoint, reason, retry_s)
            return
        link.refusal = str(reason)  # its HELLOs end
        others = [other for other in self.links.of_stage(link.stage) if other.refusal is None]
        if others:  # a planted or stale record must not end this peer (SPEC §9.2): the others first
            log.warning("%s: stage %d at %s refused this peer: %s; waiting for the stage's other DHT record(s) (%d)",
                        peer.name, msg.src, link.endpoint, reason, len(others))
            return
        anchored = (f"; stage {msg.src} holds the run's configuration (stage 0's), so fix this peer's"
                    if msg.meta.get("anchored") is True and msg.meta.get("code") in CONFIG_REFUSALS
                    and not self.links.anchored else "")
        peer.stop(PeerRejected(f"stage {msg.src} refused stage {peer.stage}: {reason}{anchored}"))

    async def _on_error(self, msg: Message, link: PeerLink) -> None:
        """ERROR is informational (SPEC §9.5): logged and counted; ``retransmit_unavailable`` (a
        micro-batch this peer waits for is lost) stops the peer, and is ``implausible`` (dropped)
        while this peer awaits no retransmission from that neighbour (1.7)."""
        peer = self.peer
        code = str(msg.meta.get("code"))
        if code == "retransmit_unavailable" and not (link.codebooks is not None and link.codebooks.awaiting):
            self.rejects("implausible", link.name, f"ERROR {code} but this peer awaits no retransmission from "
                                                   f"stage {msg.src}")
            return
        self.result.errors[code] = self.result.errors.get(code, 0) + 1
        log.warning("%s: stage %d reports an error: %s: %s", peer.name, msg.src, code, msg.meta.get("message"))
        if code == "retransmit_unavailable":
            peer.stop(MaplError(f"stage {msg.src} failed: {msg.meta.get('message')}"))

    async def _on_bye(self, msg: Message, link: PeerLink) -> None:
        """BYE ``"rejoin"``: the swarm re-forms. Otherwise the neighbour leaves (the BYE from upstream
        that ends the run is the schedule's, :meth:`~.ingress.Ingress.for_schedule`; this is one
        before training, or from downstream): a planned departure with ``reason`` ``"drain"``, else
        it left before the end (SPEC §9.5)."""
        peer = self.peer
        reason = str(msg.meta.get("reason", ""))
        if peer.handshaking and reason not in (REJOIN_REASON, DRAIN_REASON):
            # a peer that stopped before training (a refused handshake, a replacement that must
            # resume): its stage is free for another peer, this peer keeps waiting for one
            link.end_sessions()
            self.monitor.forget(link.name)
            log.warning("%s: stage %d left before training (%s); waiting for another stage %d peer", peer.name,
                        msg.src, reason, msg.src)
            return
        if link.is_upstream and peer.started and self.ingress().premature_finish(msg):
            # only the run's last step ends it: a neighbour that says so earlier leaves (a departure)
            self.rejects("implausible", link.name, f"BYE '{reason}' at step {msg.step}, but the run ends at step "
                                                   f"{self.cfg.run.steps}")
            peer.depart(link, "left", f"it said the training finished at step {msg.step}, before the run's last "
                                      f"step {self.cfg.run.steps}")
            return
        if reason == REJOIN_REASON:
            lost = msg.meta.get("lost")
            if self._implausible_reform(msg, epoch=None, lost=lost) or not self._has_credit(link, msg):
                return
            departed = f" (stage {lost} departed)" if lost is not None else ""
            peer.pause(f"stage {msg.src} re-forms the swarm{departed}", epoch=max(peer.epoch + 1, msg.epoch),
                       lost=lost, told_by=msg.src)
            return
        peer.depart(link, "drain" if reason == DRAIN_REASON else "left", reason,
                    after=msg.step if reason == LEAVE_REASON else None)

    async def _on_resync(self, msg: Message, link: PeerLink) -> None:
        if link.codebooks is None:
            self.rejects("not_allowed", link.name, "RESYNC but the codec has no codebooks")
        elif (why := link.codebooks.on_resync(msg)) is not None:
            self.rejects("implausible", link.name, why)

    @staticmethod
    def _unproven_drain(msg: Message, identity: Membership) -> str | None:
        """Why a CHECKPOINT ``drain`` does not prove that stage 0 decided it (a certified run: its
        certificate and signature of the step and run epoch, passed on unchanged, SPEC §5.2), or None."""
        try:  # the decoder made sure a drain has a uint step
            identity.verify_drain(dict(msg.meta), epoch=msg.epoch, step=msg.meta["step"])
        except CertificateError as exc:
            return f"a drain decision stage 0 did not sign ({exc.code}: {exc})"
        return None

    async def _on_checkpoint(self, msg: Message, link: PeerLink) -> None:
        phase = msg.meta["phase"]
        identity = link.settings.identity
        if phase == "drain_request" and identity is not None \
                and "drain" not in getattr(link.peer_certificate, "roles", ()):
            self.rejects("not_allowed", link.name, f"drain request from stage {link.stage}, whose certificate "
                                                   f"does not allow it (role drain; SPEC §7.2)")
        elif phase == "drain" and identity is not None and (why := self._unproven_drain(msg, identity)) is not None:
            self.rejects("not_allowed", link.name, why)
        elif self.replicas and phase == "drain_request":  # SPEC §9.10 item 14
            if link.is_upstream or not self.peer.started:
                self.rejects("not_allowed", link.name, "drain request from upstream, or before training")
            else:
                self.schedule.drain_requested(str(msg.meta.get("reason") or f"asked by stage {link.stage}"))
        elif self.replicas:  # else only a resume's offer and decision (SPEC §9.10 item 13)
            resume = self.replica_resume()
            why = resume.on_message(msg, link) if resume is not None else "CHECKPOINT to a replica that keeps none"
            if why is not None:
                self.rejects("not_allowed", link.name, why)
        elif self.agreement.store is None and phase not in DRAIN_PHASES:
            self.rejects("not_allowed", link.name, "CHECKPOINT but this peer keeps no checkpoints")
        else:
            await self.agreement.on_message(msg)
