"""The VQ streams one pipeline stage takes part in (MAPL+VQ), behind a transport-agnostic API.

Boundary b joins stage b (sender of Z, receiver of dL/dZ) and stage b+1 (receiver of Z, sender of
dL/dZ). A stage therefore owns up to four stream ends:

==================  =========================  ==============================================
boundary            ``act`` stream (Z)          ``grad`` stream (dL/dZ)
==================  =========================  ==============================================
outbound (b = s)    :class:`VQSender`           :class:`VQReceiver`
inbound (b = s-1)   :class:`VQReceiver`         :class:`VQSender`
==================  =========================  ==============================================

Seen from the stage, ``slices_for("act", have)`` are the slices to send downstream (before the
ACT), ``slices_for("grad", have)`` those to send upstream (before the GRAD); an incoming slice goes to
:meth:`StageVQ.apply_slice` whatever its stream. The sender of boundary b's stream draws from
``generator(seed, "vq", b, stream)``, so a stage computes the same codes alone on its host as in
the single-process pipeline.

Every encode with a ``key`` (the stage's micro-batch index) keeps its input until the same key is
encoded again, so :meth:`StageVQ.reencode` can answer a retransmission request (SPEC §5.1, 1.2):
the same values encoded again, after a full slice, against the new mirror.
"""

from __future__ import annotations

import torch

from mapl_swarm.compress.codebook_sync import CodebookSlice, VQReceiver, VQSender, stream_generator
from mapl_swarm.config import VQConfig

__all__ = ["StageVQ", "STREAMS"]

STREAMS = ("act", "grad")


class StageVQ:
    """Codebook senders and receivers of one stage (``has_inbound``/``has_outbound`` boundaries)."""

    def __init__(self, s: VQConfig, stage: int, *, has_inbound: bool, has_outbound: bool, seed: int,
                 device: torch.device | str = "cpu", micro_batches: int = 1) -> None:
        self.s = s
        self.tx: dict[str, VQSender] = {}
        """Senders by stream: ``act`` on the outbound boundary, ``grad`` on the inbound one."""
        self.rx: dict[str, VQReceiver] = {}
        """Receivers by stream: ``act`` on the inbound boundary, ``grad`` on the outbound one."""
        if has_outbound:
            self.tx["act"] = VQSender(s, "act", stream_generator(seed, stage, "act"), device,
                                      micro_batches=micro_batches)
            self.rx["grad"] = VQReceiver(s, "grad", device)
        if has_inbound:
            self.rx["act"] = VQReceiver(s, "act", device)
            self.tx["grad"] = VQSender(s, "grad", stream_generator(seed, stage - 1, "grad"), device,
                                       micro_batches=micro_batches)
        self._inputs: dict[tuple[str, int], torch.Tensor] = {}
        """Last encoded values per (stream, key), for :meth:`reencode`."""

    @staticmethod
    def _check(stream: str) -> None:
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")

    def encode(self, stream: str, z: torch.Tensor, *, learn: bool, key: int | None = None) -> torch.Tensor:
        """Codes (B, T, R, r/G) of z (B, T, r) on this stage's ``stream`` sender (fp32 math, never
        under autocast); with ``key`` z is kept for :meth:`reencode`."""
        if key is not None:
            self._inputs[(stream, key)] = z.detach()
        with torch.autocast(device_type=z.device.type, enabled=False):
            return self.tx[stream].encode(z.float(), learn=learn, first=learn and key == 0)

    def reencode(self, stream: str, key: int) -> torch.Tensor | None:
        """Retransmission: the values last encoded under ``key`` encoded again after a full slice
        (queued, to be sent first), without training the codebooks; None if they are gone."""
        z = self._inputs.get((stream, key))
        if z is None:
            return None
        self.tx[stream].request_resync()
        return self.encode(stream, z, learn=False)

    def decode(self, stream: str, codes: torch.Tensor, cver: int | None) -> torch.Tensor:
        """fp32 (B, T, r) from codes of ``stream`` encoded at version ``cver`` (None: the
        receiver's current version, i.e. no check)."""
        rx = self.rx[stream]
        return rx.decode(codes, rx.version if cver is None else cver)

    def take_slices(self, stream: str) -> list[CodebookSlice]:
        """Slices this stage's ``stream`` sender queued (``update = micro_batch``; none with
        ``step``, :meth:`slices_for`); deliver them before its next payload."""
        self._check(stream)
        tx = self.tx.get(stream)
        return tx.take_slices() if tx is not None else []

    def slices_for(self, stream: str, have: int) -> list[CodebookSlice]:
        """The slices to deliver before this stage's next ``stream`` payload to a receiver at
        version ``have`` (of this sender's slices: -1 when unknown): ``update = micro_batch``
        the slices the sender queued (one receiver: ``have`` is not needed), ``update = step`` a
        full slice when ``have`` is older than the sender's version."""
        self._check(stream)
        tx = self.tx.get(stream)
        if tx is None:
            return []
        if tx.per_step:
            return [tx.full_slice()] if have < tx.version else []
        return self.take_slices(stream)

    @property
    def per_step(self) -> bool:
        """``compression.vq.update = step``: the codebooks learn once per step."""
        return self.s.update == "step"

    def step_statistics(self) -> list[torch.Tensor]:
        """``update = step``: the senders' statistics of the step (:meth:`VQSender.step_statistics`),
        in a fixed order ([] for ``micro_batch``): replicas average them and write them back."""
        if not self.per_step:
            return []
        return [t for stream in STREAMS if stream in self.tx for t in self.tx[stream].step_statistics()]

    def end_step(self) -> None:
        """After the stage's optimizer step: ``update = step`` senders learn from the step's statistics."""
        if self.per_step:
            for tx in self.tx.values():
                tx.end_step()

    def replicated_state(self) -> dict[str, dict[str, torch.Tensor | int]]:
        """What every replica of the stage holds alike with ``update = step``: each sender's
        learned codebooks and statistics, mirror and version (empty for ``micro_batch``, where
        a sender's codebooks are its own)."""
        if not self.per_step:
            return {}
        return {stream: {"live": tx.learner.live, "share": tx.learner.share, "sums": tx.learner.sums,
                         "mirror": tx.mirror, "version": tx.version} for stream, tx in self.tx.items()}

    def clear_step(self) -> None:
        """The step is redone from its start: forget its statistics."""
        for tx in self.tx.values():
            tx.clear_step()

    def version(self, stream: str) -> int:
        """Version of this stage's ``stream`` sender (the ``cver`` of the codes it encoded last)."""
        return self.tx[stream].version

    def apply_slice(self, sl: CodebookSlice) -> str:
        """Apply a slice received from a neighbour; raises the named CodebookError if rejected."""
        self._check(sl.stream)
        rx = self.rx.get(sl.stream)
        if rx is None:
            raise ValueError(f"this stage receives no {sl.stream!r} stream")
        return rx.apply(sl)

    def request_resync(self, stream: str) -> int:
        """Receiver side: enter awaiting-resync; returns the version for RESYNC ``have``."""
        return self.rx[stream].request_resync()

    def resync_requested(self, stream: str) -> None:
        """Sender side: a RESYNC arrived, the next encode of ``stream`` sends a full slice."""
        self.tx[stream].request_resync()

    def warm_up(self, tokens: int) -> dict[str, dict[str, float]]:
        """Before the handshake: size each sender's search for this device and, with
        ``compression.vq.compile``, compile the fused search on dummy data of ``tokens`` tokens (the micro-batch's
        B x T) so the first encode does not compile (~1 min). Changes no codebook, statistic or
        random stream. Returns each sender's :meth:`VQSender.warm_up` figures by stream."""
        return {stream: tx.warm_up(tokens) for stream, tx in self.tx.items()}

    def metrics(self) -> dict[str, float]:
        """Sender metrics since the last call, keys ``vq_<stream>_<name>``; receiver rejections.
        Reads the senders' device statistics (a host sync each): call it once per step."""
        out: dict[str, float] = {}
        for stream, tx in self.tx.items():
            for k, v in tx.metrics().items():
                out[f"vq_{stream}_{k}"] = v
        for stream, rx in self.rx.items():
            out[f"vq_{stream}_rx_rejected"] = float(sum(rx.rejected.values()))
        return out

    def state_dict(self) -> dict:
        return {"tx": {k: v.state_dict() for k, v in self.tx.items()},
                "rx": {k: v.state_dict() for k, v in self.rx.items()}}

    def load_state_dict(self, st: dict) -> None:
        for k, v in st["tx"].items():
            self.tx[k].load_state_dict(v)
        for k, v in st["rx"].items():
            self.rx[k].load_state_dict(v)
