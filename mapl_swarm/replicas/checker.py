"""A replica that checks its partners' gradient shares by recomputing them (SPEC §9.10 item 15).

The host side of :mod:`.work`: the replica keeps its stage's parameters of each step it averaged
(before the step was taken) and, with its runtime, the inputs it took; a share drawn for checking
(:func:`~mapl_swarm.step.checking.drawn`) is recomputed in a thread of its own, on a second
runtime of the stage (the *shadow*, loaded with the kept parameters), from the inputs the checked
member gives (``work_inputs``), exactly as :meth:`~.gradients.ReplicaGradients.average` forms a
share (the accumulated gradients scaled by M / n, in fp32), and compared with the part of that
share this replica reduced; the ACTs the member passed on and the GRADs it returned (which it
hands over with its inputs) are compared with the shadow's (:func:`differing_outputs`). Not
compared: the outbound projector's gradient, which holds the PROJ_GRADs the member received from
downstream (not among its inputs), and the codec's step statistics (none in a codec that can be
checked).

A member that answers no inputs, inputs missing a micro-batch its round named, or inputs its
neighbours did not sign (a certified run: :func:`unproven`) fails its check as a wrong share does;
a checker that cannot ask or compare (no answer at all, its own kept state gone) gives no verdict.
What a check costs is counted (:attr:`ShareChecker.counters`): shares checked and found wrong,
micro-batches recomputed, seconds, input bytes received and served.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mapl_swarm.net.identity import CertificateError
from mapl_swarm.pipeline.tensors import to_wire
from mapl_swarm.pipeline.payload import ACT_WIRE, GRAD_WIRE
from mapl_swarm.pipeline.stage import KEPT_STEPS
from mapl_swarm.wire.message import payload_digest
from mapl_swarm.step.checking import SHARE_TOLERANCE, Verdict

__all__ = ["ShareChecker", "Check", "Inputs", "pack_inputs", "unpack_inputs", "unproven", "differing_outputs"]

log = logging.getLogger(__name__)

INPUTS_TIMEOUT_S = 30.0
"""How long a checker waits for a member's inputs."""
INPUT_ASKS = 4
INPUT_ASK_GAP_S = 3.0
"""A member that answers no inputs is asked again after this many seconds, :data:`INPUT_ASKS` times in
all: an empty answer is also what a member gives a caller it does not see as a member yet (its read
of the stage's DHT records lags under load), and an honest share must not be found wrong for it."""
VERDICT_ROUNDS = 3
"""Rounds a verdict is gathered in (a round whose attempt failed gathers it again)."""
KEPT_STATES = 3
"""Steps whose parameters a checking replica keeps (in host memory): a share is drawn in the next
round and checked at once, unless the checker's thread is behind (then it gives no verdict)."""


@dataclass(frozen=True)
class Check:
    """A share to check: member ``peer`` (``contact``) at ``step`` of run epoch ``epoch``, over its
    micro-batches ``micro``."""

    peer: str
    contact: str
    step: int
    epoch: int
    micro: tuple[int, ...]


Inputs = dict[int, dict[str, dict[str, Any]]]
"""A step's work by micro-batch: its inputs ``"fwd"``/``"bwd"`` (tensors by payload key) with their
senders' proofs ``"fwd_proof"``/``"bwd_proof"`` (``cert``, ``sig``) where they came with one, and its
outputs ``"out"`` (the ACT passed on) and ``"back"`` (the GRAD returned)."""
SIDES = ("fwd", "bwd", "out", "back")
OUTPUT_TOLERANCE = 1e-2
"""How far (‖sent − recomputed‖ / ‖recomputed‖, per tensor) an ACT passed on or a GRAD returned may be
from its recomputation: both are in the wire dtype (bf16: 2^-9 of each value), computed on other
kernels."""


def pack_inputs(inputs: Inputs) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A step's kept work (:attr:`~mapl_swarm.pipeline.stage.StageRuntime.kept_inputs`) as
    ``work_inputs`` metadata (``fields``: ``[micro, side, name]`` per tensor, ``side`` one of
    :data:`SIDES`; ``proofs``: ``[micro, "fwd"|"bwd", cert, sig]``) and tensors."""
    fields, tensors, proofs = [], [], []
    for micro in sorted(inputs):
        for kind in SIDES:
            for name, t in inputs[micro].get(kind, {}).items():
                fields.append([int(micro), kind, str(name)])
                tensors.append(t.detach().cpu())
            proof = inputs[micro].get(f"{kind}_proof")
            if proof is not None:
                proofs.append([int(micro), kind, proof["cert"], proof["sig"]])
    return {"fields": fields, "proofs": proofs}, tensors


def unpack_inputs(metadata: Any, tensors: list[torch.Tensor]) -> Inputs | None:
    """:func:`pack_inputs` read back; None when malformed."""
    fields = metadata.get("fields") if isinstance(metadata, dict) else None
    proofs = metadata.get("proofs", []) if isinstance(metadata, dict) else None
    if not isinstance(fields, list) or len(fields) != len(tensors) or not isinstance(proofs, list):
        return None
    out: Inputs = {}
    for f, t in zip(fields, tensors):
        if not (isinstance(f, list) and len(f) == 3 and type(f[0]) is int and f[1] in SIDES
                and isinstance(f[2], str)):
            return None
        out.setdefault(f[0], {}).setdefault(f[1], {})[f[2]] = t
    for p in proofs:
        if not (isinstance(p, list) and len(p) == 4 and p[0] in out and p[1] in ("fwd", "bwd")
                and isinstance(p[2], bytes) and isinstance(p[3], bytes)):
            return None
        out[p[0]][f"{p[1]}_proof"] = {"cert": p[2], "sig": p[3]}
    return out


def differing_outputs(sent: Inputs, recomputed: Inputs) -> str | None:
    """Why the ACTs a member passed on or the GRADs it returned (``sent``'s ``"out"``, ``"back"``)
    are not what its inputs give (``recomputed``): a tensor missing, of another shape or dtype, ids
    not equal, or floats off by more than :data:`OUTPUT_TOLERANCE`; None when they are."""
    for micro, want in sorted(recomputed.items()):
        for side, what in (("out", "ACT it passed on"), ("back", "GRAD it returned")):
            for key, t in want.get(side, {}).items():
                got = sent[micro].get(side, {}).get(key)
                if got is None or got.shape != t.shape or got.dtype != t.dtype:
                    return f"the {what} for micro-batch {micro} has no {key!r} of its inputs' shape"
                if not t.is_floating_point():
                    if not torch.equal(got, t):
                        return f"the {what} for micro-batch {micro} carries other {key!r} than its inputs"
                    continue
                norm = float(t.float().norm())
                off = float((got.float() - t.float()).norm())
                if off > OUTPUT_TOLERANCE * norm:
                    return (f"the {what} for micro-batch {micro} is {off / max(norm, 1e-30):.3g} of its "
                            f"recomputation's norm away from it ({key!r}; tolerance {OUTPUT_TOLERANCE:g})")
    return None


def unproven(inputs: Inputs, identity: Any, *, stage: int, last: bool, step: int) -> str | None:
    """Why ``inputs`` of ``step`` at ``stage`` are not what the neighbour stages' members sent (each
    ACT signed by a member of ``stage`` − 1, each GRAD by one of ``stage`` + 1, over its micro-batch
    and bytes: SPEC §9.10 item 15), or None."""
    for micro, got in sorted(inputs.items()):
        for side, kind, wire, sender, needed in (("fwd", "ACT", ACT_WIRE, stage - 1, stage > 0),
                                                 ("bwd", "GRAD", GRAD_WIRE, stage + 1, not last)):
            if not needed:
                continue
            proof, tensors = got.get(f"{side}_proof"), got.get(side)
            if proof is None or not tensors:
                return f"its {kind} of micro-batch {micro} came without its sender's proof"
            try:
                digest = payload_digest({wire[key]: to_wire(t.contiguous()) for key, t in tensors.items()})
                identity.verify_work(proof, kind=kind, step=step, micro=micro, digest=digest, stage=sender)
            except (CertificateError, KeyError, ValueError) as exc:
                return f"its {kind} of micro-batch {micro} is not what a member of stage {sender} signed ({exc})"
    return None


class ShareChecker:
    """Checks the shares of ``runtime``'s partners (a :class:`~mapl_swarm.pipeline.stage.StageRuntime`
    of a stage whose replicas check each other); ``averager``: the stage's
    :class:`~.averaging.StageAverager` (set once it exists); ``build``: a fresh runtime of the stage
    (the shadow, built at the first check)."""

    def __init__(self, runtime: Any, build: Callable[[], Any], identity: Any = None) -> None:
        self.runtime = runtime
        self.identity = identity
        """This replica's certified identity: a checked member's inputs must carry its neighbours'
        signatures (:func:`unproven`). None (an insecure run): inputs are taken as given."""
        self.averager: Any = None
        self._build = build
        self._shadow: Any = None
        self._states: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._verdicts: list[tuple[Verdict, int]] = []  # with the rounds left to gather it in
        self._jobs: queue.Queue[Check | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition(self._lock)
        self.counters = {"shares_checked": 0, "shares_wrong": 0, "micro_batches_recomputed": 0, "check_s": 0.0,
                         "input_bytes": 0, "served_input_bytes": 0, "largest_ok_difference": 0.0}
        """What checking cost and found so far (read with :meth:`report`)."""
        threading.Thread(target=self._work, name="share-checker", daemon=True).start()

    # ------------------------------------------------------------------ what this replica keeps
    def keep_state(self, step: int) -> None:
        """The stage's parameters now, before ``step`` is taken (call after its round)."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.runtime.modules.state_dict().items()}
        with self._lock:
            self._states[step] = state
            for old in sorted(self._states)[:-KEPT_STATES]:
                del self._states[old]

    def inputs_of(self, step: int, epoch: int) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """This replica's inputs of ``step`` (``work_inputs``; the attempt its step was taken with)."""
        kept = self.runtime.kept_inputs.get(step)
        if kept is None:
            return None
        metadata, tensors = pack_inputs(kept)
        with self._lock:
            self.counters["served_input_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return metadata, tensors

    def report(self) -> dict[str, Any]:
        """A copy of :attr:`counters`."""
        with self._lock:
            return dict(self.counters)

    # ------------------------------------------------------------------ verdicts
    def gathered(self) -> list[list]:
        """The verdicts to gather in the next round."""
        with self._lock:
            return [v.gathered() for v, _ in self._verdicts]

    def delivered(self) -> None:
        """A round went to the step logic: each verdict is gathered in fewer rounds more."""
        with self._lock:
            self._verdicts = [(v, n - 1) for v, n in self._verdicts if n > 1]

    def queue(self, check: Check) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(check)

    def settled(self, timeout: float) -> bool:
        """Wait until every queued check has its verdict (or failed here); False after ``timeout`` s."""
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._jobs.put(None)

    # ------------------------------------------------------------------ the checks (their thread)
    def _work(self) -> None:
        while (check := self._jobs.get()) is not None:
            try:
                self._run(check)
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def _run(self, check: Check) -> None:
        t0 = time.perf_counter()
        try:
            ok, why = self._check(check)
        except Exception as exc:  # a fault of this replica's, not the member's: no verdict
            log.warning("stage %d: checking the share of %s for step %d failed here: %r",
                        self.runtime.stage, check.contact, check.step, exc)
            return
        with self._lock:
            self.counters["shares_checked"] += 1
            self.counters["check_s"] += time.perf_counter() - t0
            self.counters["shares_wrong"] += not ok
            self._verdicts.append((Verdict(check.peer, check.step, ok), VERDICT_ROUNDS))
        if ok:
            log.info("stage %d: the share of %s for step %d checks out (%s)", self.runtime.stage, check.contact,
                     check.step, why)
        else:
            log.warning("stage %d: the gradient share of replica %s (peer id %s) for step %d is not its work: "
                        "%s", self.runtime.stage, check.contact, check.peer, check.step, why)

    def _check(self, check: Check) -> tuple[bool, str]:
        with self._lock:
            state = self._states.get(check.step)
        if state is None or self.runtime.step_count - check.step > KEPT_STEPS - 1:
            # too late: the member may no longer keep its inputs of the step (so no verdict either way)
            raise RuntimeError(f"step {check.step} is too far behind this replica's {self.runtime.step_count}")
        got = None
        for attempt in range(INPUT_ASKS):
            got = self.averager.fetch_inputs(check.peer, check.step, check.epoch, timeout=INPUTS_TIMEOUT_S)
            if got is not None:
                break
            if attempt + 1 < INPUT_ASKS:
                time.sleep(INPUT_ASK_GAP_S)  # an answer refused while it does not see this one as a member yet
        if got is None:
            return False, (f"it answered no inputs of the step, asked {INPUT_ASKS} times in "
                           f"{(INPUT_ASKS - 1) * INPUT_ASK_GAP_S:g} s (it keeps those of its last steps)")
        inputs = unpack_inputs(*got)
        with self._lock:
            self.counters["input_bytes"] += sum(t.numel() * t.element_size() for t in got[1])
        if inputs is None or not set(check.micro) <= set(inputs):
            return False, (f"its inputs name micro-batches {sorted(inputs or [])}, its round named "
                           f"{sorted(check.micro)}")
        inputs = {m: inputs[m] for m in check.micro}
        if self.identity is not None and (why := unproven(inputs, self.identity, stage=self.runtime.stage,
                                                           last=self.runtime.is_last, step=check.step)) is not None:
            return False, why
        try:
            flat, skip, outputs = self._recompute(state, inputs, check.micro)
        except (KeyError, ValueError) as exc:  # a payload missing, or of the wrong shape (others: this replica's)
            return False, f"its inputs do not run: {type(exc).__name__}: {exc}"
        if (why := differing_outputs(inputs, outputs)) is not None:
            return False, why
        with self._lock:
            self.counters["micro_batches_recomputed"] += len(check.micro)
        found = self.averager.compare_share(check.peer, check.step, check.epoch, flat, skip)
        if found is None:
            raise RuntimeError(f"no part of its share of step {check.step} is kept here")
        how = (f"its part reduced here ({found.values} values) is {found.relative:.3g} of the recomputation's norm "
               f"away from it, over its {len(check.micro)} micro-batch(es); tolerance {SHARE_TOLERANCE:g}")
        ok = found.relative <= SHARE_TOLERANCE
        if ok:
            with self._lock:  # how close honest work came to the tolerance
                self.counters["largest_ok_difference"] = max(self.counters["largest_ok_difference"], found.relative)
        return ok, how

    def _recompute(self, state: dict[str, torch.Tensor], inputs: Inputs, micro: tuple[int, ...]
                   ) -> tuple[torch.Tensor, list[tuple[int, int]], Inputs]:
        """The share ``micro`` give from ``inputs`` with the parameters ``state``, as one flat fp32
        vector in the all-reduce's order, the ranges not compared, and each micro-batch's outputs
        (``"out"``, ``"back"``, as the member's)."""
        if self._shadow is None:
            self._shadow = self._build()
            self._shadow.recording = False
        shadow = self._shadow
        shadow.abandon_step()
        shadow.modules.load_state_dict(state)
        outputs: Inputs = {}
        with torch.enable_grad():
            for m in micro:
                fwd = inputs[m]["fwd"]
                out = shadow.forward(m, ids=fwd["ids"]) if shadow.is_first else shadow.forward(m, payload=fwd)
                back = shadow.backward(m, None if shadow.is_last else inputs[m]["bwd"])
                outputs[m] = {side: {k: t.detach().cpu() for k, t in got.items()}
                              for side, got in (("out", out.payload), ("back", back)) if got is not None}
        scale = shadow.cfg.pipeline.num_micro_batches / len(micro)
        parts, skip, at = [], [], 0
        outbound = shadow.outbound.projector if shadow.outbound is not None and shadow.outbound.trainable else None
        for p in shadow.optimized_parameters():
            g = torch.zeros(p.numel()) if p.grad is None else \
                p.grad.detach().to("cpu", torch.float32).reshape(-1) * scale
            if p is outbound:
                skip.append((at, at + p.numel()))
            parts.append(g)
            at += p.numel()
        for t in shadow.step_statistics():
            skip.append((at, at + t.numel()))
            parts.append(torch.zeros(t.numel()))
            at += t.numel()
        shadow.abandon_step()
        return torch.cat(parts), skip, outputs
