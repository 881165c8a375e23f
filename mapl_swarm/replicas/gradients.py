"""A stage replica's step: its accumulated gradients averaged with the stage's other replicas.

Every replica of stage k processes some of the step's global micro-batches; the runtime scales each
micro-batch's loss by ``1 / num_micro_batches`` (the global count), so a replica's accumulated
gradient is its share of the global one. At the step's end each replica pre-scales its gradients to
the mean over its own micro-batches (``× num_micro_batches / n``; a replica that computed none sends
zeros with weight 0) and averages them with the other replicas weighted by ``n`` (hivemind's
all-reduce through :class:`~.averaging.StageAverager`): the result is the global batch's gradient,
the same bytes on every replica, and every replica takes the same optimizer step. With
``replicas.averaging`` other than ``fp32`` what crosses is compressed (:mod:`.schemes`): the
result is then the scheme's approximation of that gradient, still the same bytes everywhere, and
each replica keeps its own error feedback (:meth:`ReplicaGradients.own_state`). With
``replicas.averaged = "updates"`` the compressed matrices Muon trains carry each replica's own
Muon update instead (:mod:`.updates`), which :meth:`ReplicaGradients.apply_updates` adds to them
before the runtime's optimizers step the other tensors from their averaged gradients. A sender's
projector gradient holds what its receivers sent it (PROJ_GRAD), so it is averaged with the rest:
every replica of the sender applies the same SPEL step and sends the same next projector version.
The codec's step statistics (MAPL+VQ with ``compression.vq.update = step``: each codebook sender's
usage and sums over the step, and the proposal made from the step's first micro-batch) are shares
of the step's value too and are averaged with the gradients, so every replica's codebooks take the
same update; the digest a round compares covers those codebooks beside the parameters.

Each replica gathers, with the round, the digest of its parameters before the step, the indices
(within the step) of the micro-batches it accumulated, its step, its run epoch, its contact and (the
last stage) the sum of its micro-batches' losses (hivemind's ``gather``): a round of members at
another step or run epoch does not count (every member sees the same gathered data, so all of them
refuse it); one that counts is whole when every micro-batch of the step was accumulated exactly
once and every digest is equal (:meth:`ReplicaStep.problem`); its sorted peer ids rank the stage's
replicas for the next step (stage 0 splits the data by them). The runtime's parameters receive the
average only from a round that counts: a round that failed or was cancelled
(:meth:`ReplicaGradients.cancel`, a replica of the stage left) leaves the replica's own gradients
in place. A member whose all-reduce broke after it began takes the result of a partner that kept
the round (:mod:`.kept_round`); when every partner's broke too, nobody kept it and the round is run
again; otherwise it is *unsure* (:class:`AveragingFailed` ``unsure``) and the step is redone by all
replicas. A stage with one
live replica takes its step alone (``expected`` 1: no round). Before the first step a
:meth:`ReplicaGradients.sync` round (nothing averaged) finds the replicas that start together and
checks that they hold the same parameters.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from mapl_swarm.errors import MaplError
from mapl_swarm.replicas.averaging import GATHER_ONLY, NobodyKept, StageAverager
from mapl_swarm.replicas.checker import Check, ShareChecker
from mapl_swarm.replicas.errors import AveragingFailed, Behind, RoundCancelled
from mapl_swarm.replicas.schemes import (LowRank, Sparse, compressible, feedback, initial_factors, low_rank_plan,
                                         sparse_decoded, sparse_plan, sparse_share, with_feedback)
from mapl_swarm.replicas.state import state_summary
from mapl_swarm.replicas.updates import LocalUpdates, updated
from mapl_swarm.rng import derive_seed
from mapl_swarm.step.checking import Accusations, divergent, drawn, stubborn
from mapl_swarm.step.rounds import (NONCE_BYTES, RESUME_STEP, SYNC_STEP, ReplicaStep, commitment, read_round,
                                    round_counts)

__all__ = ["ReplicaGradients", "exact_tensors", "ReplicaStep", "read_round", "round_counts", "AveragingFailed", "Behind",
           "RoundCancelled", "SYNC_STEP", "RESUME_STEP"]

log = logging.getLogger(__name__)

BROKEN_ROUNDS = 2
"""All-reduces in a row whose parts a member did not send that exclude it (replicas that check each
other's work): an honest replica that breaks one by leaving is gone before the next."""
FIND_GROUP_S = 5.0
"""Least seconds one attempt of a round looks for its group (three matchmakings when longer): a
replica that left is counted out of the round at the next attempt."""


def exact_tensors(runtime: Any) -> list[int]:
    """The averaged tensors of stage ``runtime`` that compression leaves exact whatever their shape
    (indices among its optimized parameters, then its codec's step statistics): the MAPL
    projectors' gradients and the statistics."""
    params, stats = list(runtime.optimized_parameters()), runtime.step_statistics()
    projectors = [b.projector for b in (runtime.inbound, runtime.outbound)
                  if b is not None and getattr(b, "projector", None) is not None]
    return [i for i, p in enumerate(params) if any(p is q for q in projectors)] + \
        list(range(len(params), len(params) + len(stats)))


def _stop(control: Any) -> None:
    """Cancel hivemind's round ``control`` unless it is over (its futures then refuse a result)."""
    if control is not None and not control.done():
        try:
            control.cancel()
        except asyncio.InvalidStateError:  # it ended meanwhile
            pass


class ReplicaGradients:
    """The gradients of stage replica ``runtime`` (a :class:`~mapl_swarm.pipeline.stage.StageRuntime`),
    averaged among the replicas of its stage in run ``run_id`` through ``dht`` (the replica's
    certified DHT node); a round starts at once when ``replicas`` are in. ``identity``: the
    replica's certified identity, with which it checks its partners' inputs (SPEC §9.10 item 15).
    Create it before the event loop and torch threads (it forks); :meth:`attach` a session's
    runtime of the same shapes."""

    def __init__(self, runtime: Any, dht: Any, *, run_id: str, replicas: int, identity: Any = None,
                 **averager_kwargs: Any) -> None:
        self.runtime = runtime
        self.params = list(runtime.optimized_parameters())
        self.stats = list(runtime.step_statistics())
        """The codec's step statistics (MAPL+VQ ``update = step``), averaged like the gradients."""
        r = runtime.cfg.replicas
        shapes = [tuple(t.shape) for t in [*self.params, *self.stats]]
        exact = exact_tensors(runtime)
        self.scheme = r.averaging
        """``replicas.averaging``: what this replica sends to average (:mod:`.schemes`)."""
        self.last_sent = 0
        """Tensor bytes this replica's last counted averaging round sent (its status record shows it)."""
        self.low_rank: LowRank | None = low_rank_plan(shapes, r.averaging_rank, exact=exact) \
            if r.averaging == "powersgd" else None
        """With ``replicas.averaging = "powersgd"``: which averaged tensors are compressed (:mod:`.schemes`)."""
        self.sparse: Sparse | None = sparse_plan(shapes, r.topk_fraction, exact=exact) \
            if r.averaging == "topk" else None
        """With ``replicas.averaging = "topk"``: which averaged tensors are sent sparse (:mod:`.schemes`)."""
        self._compressed = self.low_rank.matrices if self.low_rank is not None else \
            self.sparse.tensors if self.sparse is not None else ()
        factors = initial_factors(self.low_rank, derive_seed(runtime.cfg.run.seed, "powersgd", runtime.stage)) \
            if self.low_rank is not None else []
        buffers = [torch.zeros(shape, dtype=torch.float32) for shape in shapes] + factors  # contiguous
        self.errors: list[torch.Tensor] | None = [torch.zeros(shapes[i]) for i in self._compressed] \
            if self._compressed and r.error_feedback else None
        """This replica's error feedback, one buffer per compressed tensor (its own; checkpointed)."""
        self.averaged = r.averaged
        """``replicas.averaged``: whether the compressed tensors carry gradients or optimizer updates."""
        self._updated = updated(runtime.optimizers, self.params, self._compressed) if r.averaged == "updates" else ()
        """The compressed tensors that carry this replica's own update (:func:`.updates.updated`)."""
        self.updates = self._local_updates(runtime)
        """With ``averaged = "updates"``: this replica's own Muon step of the compressed matrices Muon trains."""
        self._averaged_updates: list[torch.Tensor] | None = None
        """The stage's averaged updates of the compressed matrices from the last round that counted,
        until :meth:`apply_updates` adds them."""
        self._served: Callable[[], Any] = lambda: self.runtime.state_dict()
        self.check_fraction = runtime.cfg.replicas.check_fraction
        self.checker = ShareChecker(runtime, partial(type(runtime), runtime.cfg, runtime.stage, runtime.device),
                                    identity) if self.check_fraction > 0 else None
        """Checks the partners' shares (SPEC §9.10 item 15; ``replicas.check_fraction`` above 0)."""
        self.accusations = Accusations()
        self._checked: ReplicaStep | None = None
        """The last round whose all-reduce ran and whose shares are not drawn yet."""
        self._breaks: dict[str, int] = {}
        """Each member's all-reduces of this replica broken in a row (:meth:`_broken`)."""
        self._previous: ReplicaStep | None = None
        """The last step round that went to the core (a member stubbornly divergent in it and the next
        is excluded)."""
        self.excluded: list[tuple[str, str, int, frozenset[str]]] = []
        """(peer id, contact, step, accusers) of each member the stage's rounds excluded, in order
        (:meth:`take_excluded`)."""
        self._told = 0
        self.averager = StageAverager(buffers, dht, run_id=run_id, stage=runtime.stage, replicas=replicas,
                                      aggregation=r.aggregation, scheme=r.averaging, low_rank=self.low_rank,
                                      sparse=self.sparse,
                                      half=compressible(shapes, exact) if r.averaging == "fp16" else None,
                                      state=lambda: self._served(),
                                      start=True,
                                      usable=partial(round_counts, runtime.cfg.pipeline.num_micro_batches),
                                      inputs=(lambda step, epoch: self.checker.inputs_of(step, epoch))
                                      if self.checker is not None else None,
                                      **averager_kwargs)
        if self.averager.client_mode:
            log.info("stage %d: averaging as a dial-out member (hivemind's client mode): its partners reduce every "
                     "part and reach it over the connections it opens", runtime.stage)
        if self.checker is not None:
            self.checker.averager = self.averager
        self.me = str(self.averager.peer_id)
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        """Committed to in the rounds until one goes to the core (:meth:`_delivered`)."""
        self._revealed: bytes | None = None
        """The nonce of the last round that went to the core, revealed in the next."""
        self._lock = threading.Lock()
        self._control: Any = None
        self._cancelled = False
        self.find_s = max(FIND_GROUP_S, 3 * averager_kwargs.get("min_matchmaking_time", 2.0))
        """Seconds one attempt of a round looks for its group (:meth:`cancel` says why it is bounded)."""

    def _local_updates(self, runtime: Any) -> LocalUpdates | None:
        """This replica's own step of :attr:`_updated` (the same indices in any runtime it attaches)."""
        return LocalUpdates(runtime.optimizers, [self.params[i] for i in self._updated], runtime.stage) \
            if self._updated else None

    def own_state(self) -> dict[str, Any]:
        """What of the averaging is this replica's own and goes into its checkpoints: the scheme,
        its error feedback and the warm-start factors (empty lists without PowerSGD)."""
        factors: list[torch.Tensor] = []
        if self.low_rank is not None:
            with self.averager.get_tensors() as buffers:
                factors = [t.clone() for t in buffers[len(buffers) - len(self.low_rank.matrices):]]
        return {"scheme": self.scheme, "averaged": self.averaged,
                "errors": [e.clone() for e in self.errors] if self.errors is not None else [], "factors": factors}

    def load_own_state(self, state: dict[str, Any] | None) -> None:
        """Continue from :meth:`own_state` of a checkpoint (None, or one of another scheme or
        shapes, or whose compressed tensors carried the other of gradients and updates: the error
        feedback starts at zero and the factors where they are)."""
        if not isinstance(state, dict) or state.get("scheme") != self.scheme or \
                state.get("averaged", "gradients") != self.averaged:
            if self.errors is not None:
                for e in self.errors:
                    e.zero_()
            return
        errors, factors = state.get("errors", []), state.get("factors", [])
        if self.errors is not None and [tuple(t.shape) for t in errors] == [tuple(e.shape) for e in self.errors]:
            for e, saved in zip(self.errors, errors):
                e.copy_(saved)
        if self.low_rank is not None and len(factors) == len(self.low_rank.matrices):
            with self.averager.get_tensors() as buffers:
                for slot, saved in zip(buffers[len(buffers) - len(factors):], factors):
                    if slot.shape == saved.shape:
                        slot.copy_(saved)

    @property
    def error_norm(self) -> float:
        """The norm of this replica's error feedback (0 without it)."""
        if not self.errors:
            return 0.0
        return float(torch.sqrt(sum(e.double().pow(2).sum() for e in self.errors)))

    def attach(self, runtime: Any) -> None:
        """Average ``runtime``'s gradients from now on (a new session's stage, built the same way)."""
        params, stats = list(runtime.optimized_parameters()), list(runtime.step_statistics())
        if [p.shape for p in [*params, *stats]] != [p.shape for p in [*self.params, *self.stats]]:
            raise ValueError(f"stage {runtime.stage}: another runtime's parameters")
        self.runtime, self.params, self.stats = runtime, params, stats
        self.updates, self._averaged_updates = self._local_updates(runtime), None
        if self.checker is not None:
            self.checker.runtime = runtime

    def serve(self, state: Callable[[], Any]) -> None:
        """What a joining replica downloads from this one from now on: ``state()`` (read in a thread
        of this process; a consistent copy, see :mod:`.state`)."""
        self._served = state

    def download(self, likes: Sequence[Any], *, timeout: float, sources: Sequence[str] = ()) -> Any | None:
        """The stage's state from a live replica, checked against the first of ``likes`` (forms of
        this replica's own, of what :meth:`serve` gives) it fits; None when no replica answered
        within ``timeout`` s."""
        return self.averager.download_state(*likes, timeout=timeout, sources=sources)

    def cancel(self) -> None:
        """Make the round in progress give up with :class:`RoundCancelled` once it stops looking
        for its group without one (the next round, if none is in progress); thread-safe: the event
        loop calls it while the compute thread waits in the round. hivemind's round itself is not
        cancelled: a round cancelled while it looks for a group can leave its matchmaking locked,
        and this replica's next round waiting behind it for good; so every attempt looks for its
        group :attr:`find_s` at most, and a round whose group formed goes on to its end (a member
        that left fails it, one that completed counts)."""
        with self._lock:
            self._cancelled = True

    def _round(self, weight: float, gather: dict[str, Any], timeout: float) -> ReplicaStep:
        return self._result(*self._gathered(weight, gather, timeout))

    def _gathered(self, weight: float, gather: dict[str, Any], timeout: float) -> tuple[dict[str, Any], int, int]:
        """One round: what its members gathered (by peer id as text) and the tensor bytes this
        replica's all-reduce sent and received."""
        sent, received = self.averager.traffic
        with self._lock:
            if self._cancelled:
                self._cancelled = False
                raise RoundCancelled(f"stage {self.runtime.stage}: the averaging round was cancelled")
            self._control = self.averager.step(weight=weight, gather=gather, timeout=min(timeout, self.find_s),
                                               allow_retries=False, wait=False)
        try:
            gathered = self._control.result(timeout=timeout)
        except BaseException as exc:  # cancelled, failed (a member left mid-round) or timed out
            with self._lock:
                cancelled, self._cancelled = self._cancelled, False
            # once the all-reduce began, a partner may have got every part and kept the round,
            # unless every partner said that its all-reduce broke too
            began = bool(self._control.began_allreduce)
            unsure = began and not isinstance(exc, NobodyKept)
            if cancelled:
                raise RoundCancelled(f"stage {self.runtime.stage}: the averaging round was cancelled",
                                     unsure=unsure) from None
            if began and self.checker is not None:
                self._broken(self.averager.culprits, int(gather.get("step", SYNC_STEP)))
            if not unsure and "could not find a group" in str(exc):  # hivemind's words for a lone member
                raise AveragingFailed(f"stage {self.runtime.stage}: no group of the stage's replicas formed within "
                                      f"{min(timeout, self.find_s):g} s (a partner is not at this round yet)") from None
            raise AveragingFailed(f"stage {self.runtime.stage}: the averaging round failed"
                                  f"{' after its all-reduce began' if unsure else ''}: {type(exc).__name__}: {exc}",
                                  unsure=unsure) from None
        finally:
            with self._lock:
                _stop(self._control)  # an all-reduce still on after the whole wait (stalled) stops here
                self._control = None
        with self._lock:
            self._cancelled = False  # a round that completed counts, whatever came meanwhile
        sent, received = (now - before for now, before in zip(self.averager.traffic, (sent, received)))
        if gathered is None:
            raise AveragingFailed(f"stage {self.runtime.stage}: the replicas formed no averaging group within "
                                  f"{timeout:g} s")
        return {str(peer): value for peer, value in gathered.items()}, sent, received

    def _result(self, data: dict[str, Any], sent: int = 0, received: int = 0) -> ReplicaStep:
        round_ = read_round(self.me, data, sent, received)
        if round_ is None:
            raise AveragingFailed(f"stage {self.runtime.stage}: a replica gathered something else than a round's "
                                  f"digest, micro-batches, loss, epoch, contact, step and expected count")
        return round_

    def sync(self, *, timeout: float, epoch: int = 0, contact: str = "", expected: int = 2,
             behind: bool = False) -> ReplicaStep:
        """The round before the first step: the ``expected`` replicas that start together, each one's
        parameter digest (gathered only: no all-reduce, whose failure at one member could leave
        another past the round). ``expected`` 1: this replica starts its stage alone (no round).
        ``behind``: this replica resumed without the agreed step's file (gathered as ``behind``). A
        group of fewer than ``expected`` (hivemind forms one of 2 once its matchmaking time passed)
        is refused by every member alike, which all try again: the one left out would otherwise
        average alone for good."""
        gather = {**self._gather([], 0.0, epoch, contact, SYNC_STEP, expected), **({"behind": True} if behind else {})}
        if expected <= 1:
            return self._delivered(self._result({self.me: gather}))
        self.averager.set_group_size(expected)
        round_ = self._round(1.0, {**gather, GATHER_ONLY: True}, timeout)
        if round_.group_size < round_.expected:
            raise AveragingFailed(f"stage {self.runtime.stage}: a sync round of {round_.group_size} of the "
                                  f"{round_.expected} replicas that start together")
        if RESUME_STEP in round_.steps.values():
            raise MaplError(f"stage {self.runtime.stage}: another replica of the stage resumes (--resume) and this "
                            f"one starts fresh: start every replica of the run with --resume, or none")
        return self._delivered(round_)

    def resume_round(self, saved: Sequence[int], reason: str, *, timeout: float, contact: str = "",
                     expected: int = 2) -> dict[str, tuple[list[int], str]]:
        """A resumed run's round before anything is loaded (SPEC §9.10 item 13): the ``expected``
        replicas that start together gather the steps whose files each may use (``saved``) and why
        it can use none (``reason``, empty when it can); each member's, by its contact and the end of
        its peer id (its whole peer id when it has no contact; gathered only).
        ``expected`` 1: this replica starts its stage alone (no round)."""
        gather = {**self._gather([], 0.0, 0, contact, RESUME_STEP, 1), "saved": [int(s) for s in saved],
                  "why": str(reason)}
        if expected <= 1:
            return {self.me: (sorted(gather["saved"]), gather["why"])}
        self.averager.set_group_size(expected)
        data, _, _ = self._gathered(1.0, {**gather, GATHER_ONLY: True}, timeout)
        where = f"stage {self.runtime.stage}"
        steps = {v.get("step") if isinstance(v, dict) else None for v in data.values()}
        if steps != {RESUME_STEP}:
            training = sorted(s for s in steps if type(s) is int and s >= 0)
            raise MaplError(f"{where}: " + (f"replicas of the stage are training (step {training[0]}): a replica joins "
                                            f"a running swarm with --join, not --resume" if training else
                                            "another replica of the stage starts fresh and this one resumes "
                                            "(--resume): start every replica of the run with --resume, or none"))
        if len(data) < expected:
            raise AveragingFailed(f"{where}: a resume round of {len(data)} of the stage's {expected} replicas")
        got = {}
        for peer, v in data.items():
            s, why = v.get("saved"), v.get("why")
            if not (isinstance(s, list) and all(type(n) is int and n >= 0 for n in s) and isinstance(why, str)):
                raise MaplError(f"{where}: replica {peer} gathered no list of checkpoint steps in the resume round")
            contact = v.get("contact")
            label = f"{contact} ({peer[-8:]})" if isinstance(contact, str) and contact else peer
            got[label if label not in got else peer] = (sorted(set(s)), why)
        return got

    def _gather(self, micro: Sequence[int], loss_sum: float, epoch: int, contact: str, step: int,
                expected: int, *, leave: bool = False, going: bool = False, drain: bool = False) -> dict[str, Any]:
        reveal = {"reveal": self._revealed.hex()} if self._revealed is not None else {}
        state = {"modules": self.runtime.modules.state_dict(), "codec": self.runtime.codec.replicated_state()}
        digest, frame, sketch = state_summary(state)
        return {"digest": digest, "frame": frame, "sketch": sketch, "micro": [int(m) for m in micro],
                "loss": float(loss_sum), "epoch": int(epoch), "contact": contact, "step": int(step),
                "expected": int(expected), "commit": commitment(self._nonce), **reveal,
                **({"audit": self.checker.gathered()} if self.checker is not None else {}),
                **{k: True for k, on in (("leave", leave), ("going", going), ("drain", drain)) if on}}

    def _delivered(self, round_: ReplicaStep, *, reduced: bool = False) -> ReplicaStep:
        """``round_`` goes to the step core: its nonce is revealed in the next round, which commits
        to a fresh one (a failed attempt's commitment is the same nonce's). ``reduced``: its
        all-reduce ran (its shares may be drawn for checking in the next round)."""
        self._revealed, self._nonce = self._nonce, secrets.token_bytes(NONCE_BYTES)
        self._check(round_, reduced)
        return round_

    def _check(self, round_: ReplicaStep, reduced: bool) -> None:
        """What ``round_`` decides of SPEC §9.10 item 15: the shares of the last round whose
        all-reduce ran (its members reveal their nonces of it here) that are drawn for checking,
        queued to :attr:`checker`, and the members its verdicts exclude (:attr:`excluded`)."""
        prior, self._checked = self._checked, round_ if reduced else None
        step = round_.steps.get(self.me, SYNC_STEP)
        if step < 0:
            return
        previous, self._previous = self._previous, round_
        if reduced:  # its members completed an all-reduce
            for peer in round_.group:
                self._breaks.pop(peer, None)
        # only a step that was taken is checked: a redone one's inputs were forgotten with its work
        taken = prior is not None and step > prior.steps.get(self.me, step)
        if self.checker is not None:
            self.checker.delivered()
            for peer in drawn(prior, round_, self.check_fraction) if taken else ():
                if peer != self.me:
                    self.checker.queue(Check(peer, prior.contacts.get(peer, ""), prior.steps[peer],
                                             prior.epochs[peer], prior.micro[peer]))
        n = round_.group_size
        why = {peer: (f"{len(accusers)} of the round's {n} replicas found its gradient share of step {wrong} not its "
                      f"work", accusers) for peer, wrong, accusers in self.accusations.add(round_)}
        for peer in stubborn(round_, previous) if self.checker is not None else ():
            if self.accusations.exclude(peer):
                holders = frozenset(p for p in round_.group if p not in divergent(round_))
                why[peer] = (f"it held other parameters than {len(holders)} of the round's {n} replicas in two rounds "
                             f"in a row, the second after it was to load their state", holders)
        for peer, (reason, accusers) in why.items():
            if peer == self.me:
                log.error("stage %d: this replica is excluded by its partners: %s (SPEC §9.10 item 15)",
                          self.runtime.stage, reason)
            else:
                self._exclude(peer, round_.contacts.get(peer, ""), reason, step, accusers)

    def _broken(self, culprits: Sequence[str], step: int) -> None:
        """This replica's all-reduce broke, ``culprits``' parts missing: a member that broke two in a
        row (no round it completed between) is excluded (SPEC §9.10 item 15), so that one member
        cannot have a step redone until the run ends."""
        for peer in culprits:
            self._breaks[peer] = self._breaks.get(peer, 0) + 1
            if self._breaks[peer] >= BROKEN_ROUNDS and self.accusations.exclude(peer):
                contact = self._previous.contacts.get(peer, "") if self._previous is not None else ""
                self._exclude(peer, contact, f"it broke {BROKEN_ROUNDS} of the stage's all-reduces in a row (its "
                                             f"parts did not come)", step, frozenset({self.me}))

    def _exclude(self, peer: str, contact: str, reason: str, step: int, accusers: frozenset[str]) -> None:
        self.averager.exclude(peer)
        self.excluded.append((peer, contact, step, accusers))
        log.error("stage %d: replica %s (peer id %s) is excluded in the round of step %d: %s (SPEC §9.10 item "
                  "15); its partners refuse it and tell the neighbour stages. Its certificate can be revoked "
                  "(mapl-swarm keys revoke)", self.runtime.stage, contact or "?", peer, step, reason)

    def take_excluded(self) -> list[tuple[str, str, int, frozenset[str]]]:
        """The members excluded since the last call."""
        out, self._told = self.excluded[self._told:], len(self.excluded)
        return out

    def average(self, micro: Sequence[int], *, step: int, timeout: float, loss_sum: float = 0.0, epoch: int = 0,
                contact: str = "", expected: int = 2, leave: bool = False, going: bool = False,
                drain: bool = False) -> ReplicaStep:
        """Average the gradients accumulated over this replica's micro-batches ``micro`` of ``step``
        (indices; empty: none) with the other replicas' (module docstring) and hand the result to
        the runtime's parameters, unless the round failed, was cancelled, formed with fewer than
        the ``expected`` live replicas of the stage or with members of another step or run epoch
        (raised; the gradients stay this replica's own: every member saw the same gathered data,
        so every one refuses such a round). ``expected`` 1: this replica is its stage's only one,
        the step is its own (no round). The caller checks the round (:meth:`ReplicaStep.problem`)
        and steps."""
        gather = self._gather(micro, loss_sum, epoch, contact, step, expected, leave=leave, going=going,
                              drain=drain)
        self._averaged_updates = None
        if self.updates is not None:
            self.updates.discard()
        if expected <= 1:
            return self._delivered(self._result({self.me: gather}))
        self.averager.set_group_size(expected)
        n = len(micro)
        scale = self.runtime.cfg.pipeline.num_micro_batches / n if n else 0.0
        stats = self.runtime.step_statistics()  # the same tensors as self.stats, filled in for the step
        filled = [*(p.grad for p in self.params), *stats]
        with self.averager.filling() as buffers, torch.no_grad():
            for buf, t in zip(buffers, filled):
                if t is None or not n:
                    buf.zero_()
                else:
                    buf.copy_(t.detach().to("cpu", torch.float32)).mul_(scale)
            if self.updates is not None and n:  # its own optimizer's step from its gradient, taken aside
                got = self.updates.compute([buffers[i] for i in self._updated], self.runtime.lr_multiplier())
                for i, u in zip(self._updated, got):
                    buffers[i].copy_(u)
            ms = self._with_feedback(buffers, n)
        round_ = self._round(float(n), gather, timeout)
        # every check below reads only what every member gathered, so all of them decide alike
        if round_.group_size < round_.expected:  # a partner not in it yet, or gone without one knowing
            raise AveragingFailed(f"stage {self.runtime.stage}: a round of {round_.group_size} of the stage's "
                                  f"{round_.expected} replicas")
        steps, epochs = set(round_.steps.values()), set(round_.epochs.values())
        if len(steps) > 1 or len(epochs) > 1:  # a redo on its way, or a joining replica one step behind
            error = Behind if max(steps) > step else AveragingFailed
            raise error(f"stage {self.runtime.stage}: a round with replicas of steps {sorted(steps)} and run epochs "
                        f"{sorted(epochs)}, this one is at step {step}, epoch {epoch}")
        if round_.problem(self.runtime.cfg.pipeline.num_micro_batches) is not None:
            return self._delivered(round_)  # it ran no all-reduce (round_counts): the caller redoes the step or stops
        with self.averager.get_tensors() as buffers, torch.no_grad():
            for buf, p in zip(buffers, self.params):
                p.grad = buf.to(p.device, p.dtype, copy=True)
            if self.updates is not None:  # added by apply_updates; the optimizers step the others
                self._averaged_updates = [buffers[i].clone() for i in self._updated]
                for i in self._updated:
                    self.params[i].grad = None
            for buf, t in zip(buffers[len(self.params):len(filled)], stats, strict=True):
                t.copy_(buf)
            if ms is not None:  # this replica's part of what compression left out, for its next steps
                for e, m, i in zip(self.errors, ms, self._compressed):
                    e.copy_(feedback(m, self._sent(m, i, buffers), n, self.runtime.cfg.pipeline.num_micro_batches))
        if self.checker is not None:
            self.checker.keep_state(step)
        self.last_sent = round_.sent_bytes
        return self._delivered(round_, reduced=True)

    def apply_updates(self) -> None:
        """With ``averaged = "updates"``, before the runtime's step: add the stage's averaged updates
        of the last round that counted to the compressed matrices (their optimizer state becomes the
        one this replica's own step led to); nothing after a round that did not count, or alone."""
        got, self._averaged_updates = self._averaged_updates, None
        if got is not None and self.updates is not None:
            self.updates.commit(got, self.runtime.step_count)

    def _with_feedback(self, buffers: Sequence[torch.Tensor], n: int) -> list[torch.Tensor] | None:
        """Add this replica's error feedback to the compressed gradients just filled into
        ``buffers`` for a round over ``n`` micro-batches; those M, kept for the feedback's update
        (None without error feedback, or with no micro-batch: weight 0, its feedback waits).

        The feedback e is kept as this replica's part of the step's average (what it left out,
        times n / M), and enters as M = g + e M / n: a replica's weight changes from step to step
        with the routing, and so the stage's whole feedback, the sum of its replicas', enters
        every average whole (PowerSGD's round then sees only the stage's sums, whoever computed
        which micro-batch)."""
        if self.errors is None or not n:
            return None
        return [with_feedback(buffers[i], e, n, self.runtime.cfg.pipeline.num_micro_batches).clone()
                for e, i in zip(self.errors, self._compressed)]

    def _sent(self, m: torch.Tensor, i: int, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        """What of ``m`` (this replica's M of averaged tensor ``i``) the round kept: PowerSGD's
        P̂ Q̂ᵀ (the averaged tensor), top-k's own share decoded."""
        if self.sparse is None:
            return buffers[i]
        return sparse_decoded(*sparse_share(m, self.sparse.counts[self.sparse.tensors.index(i)]), m)

    def shutdown(self) -> None:
        if self.checker is not None:
            self.checker.close()
        self.averager.shutdown()
