"""The averager's side of replicas checking each other's work (SPEC §9.10 item 15).

A member whose share of a step is drawn for checking is recomputed by each of its partners from
the inputs it took in that step (its ACT and GRAD payloads, stage 0's token ids), asked of it
through the averager's ``work_inputs`` call (members only, like every averager call). Each checker
compares the recomputation with the part of that member's share *it reduced itself* in the
step's all-reduce, kept for :data:`KEPT_ROUNDS` rounds: what a member sent in the all-reduce is
its word, which it cannot take back, and no member can make a partner's part look other than the
partner received it.

This module holds what runs in the averager process or crosses to it: the host's answer to
``work_inputs`` (a pipe, as hivemind's own state download asks the host), the request and its
streamed answer, and the kept parts with their comparison. What is drawn, recomputed and decided
is :mod:`.checking`'s.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

__all__ = ["KEPT_ROUNDS", "InputsOf", "KeptParts", "Comparison", "serve_inputs", "round_key", "request",
           "read_request", "answer", "receive"]

log = logging.getLogger(__name__)

KEPT_ROUNDS = 3
"""Rounds whose reduced parts a checking member keeps (a share is drawn in the next round, and its
checkers compare while the stage serves the step after)."""

InputsOf = Callable[[int, int], "tuple[dict[str, Any], list[torch.Tensor]] | None"]
"""The host's inputs of (step, run epoch): msgpack-able metadata and tensors, or None."""


def serve_inputs(inputs: InputsOf) -> Any:
    """The averager process's end of a pipe on which it asks the host for ``inputs(step, epoch)``
    (a request: ``(step, epoch, MPFuture)``); the host answers in a daemon thread. Call before
    the averager forks."""
    host_end, averager_end = mp.Pipe(duplex=True)

    def loop() -> None:
        while True:
            try:
                step, epoch, future = host_end.recv()
            except (EOFError, OSError):
                return
            try:
                future.set_result(inputs(int(step), int(epoch)))
            except BaseException as exc:  # the averager's call then answers nothing
                log.warning("the inputs of step %s could not be read: %r", step, exc)
                if not future.done():
                    future.set_result(None)

    threading.Thread(target=loop, name="work-inputs", daemon=True).start()
    return averager_end


def round_key(gathered: Any) -> tuple[int, int] | None:
    """(step, run epoch) of a round, from this member's own gathered data."""
    if isinstance(gathered, dict) and type(gathered.get("step")) is int and type(gathered.get("epoch")) is int \
            and gathered["step"] >= 0:
        return gathered["step"], gathered["epoch"]
    return None


def request(step: int, epoch: int) -> bytes:
    """A ``work_inputs`` request (carried as the message's ``group_id`` bytes)."""
    return msgpack.packb([int(step), int(epoch)])


def read_request(raw: bytes) -> tuple[int, int] | None:
    try:
        step, epoch = msgpack.unpackb(raw)
    except Exception:
        return None
    return (step, epoch) if type(step) is int and type(epoch) is int and step >= 0 and epoch >= 0 else None


def answer(metadata: bytes, tensors: Sequence[torch.Tensor]) -> Iterator[averaging_pb2.DownloadData]:
    """The streamed answer: the metadata with the first message, then each tensor in parts (as
    hivemind streams a state)."""
    if not tensors:
        yield averaging_pb2.DownloadData(metadata=metadata)
        return
    first = True
    for tensor in tensors:
        for part in split_for_streaming(serialize_torch_tensor(tensor.detach().cpu())):
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata) if first else \
                averaging_pb2.DownloadData(tensor_part=part)
            first = False


async def receive(stream: AsyncIterator[averaging_pb2.DownloadData], serializer: Any,
                  chunk_timeout: float) -> tuple[Any, list[torch.Tensor]] | None:
    """An answer's metadata and tensors; None when it was empty."""
    metadata, tensors, parts = None, [], []
    async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
        if message.metadata:
            metadata = serializer.loads(message.metadata)
        if message.tensor_part.dtype and parts:  # a new tensor begins
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        if message.tensor_part.dtype:
            parts.append(message.tensor_part)
    if parts:
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    return None if metadata is None else (metadata, tensors)


@dataclass(frozen=True)
class Comparison:
    """A member's share against its recomputation, in the part one checker reduced."""

    values: int
    """Values compared."""
    difference: float
    """‖share − recomputed‖ over those values."""
    norm: float
    """‖recomputed‖ over them."""

    @property
    def relative(self) -> float:
        return self.difference / self.norm if self.norm > 0 else (0.0 if self.difference == 0 else math.inf)


@dataclass
class KeptParts:
    """What one member's reducer received in one round: its range of the flat vector and each
    sender's values there (by peer id as text)."""

    start: int
    shares: dict[str, list[torch.Tensor]]

    def compare(self, peer: str, recomputed: torch.Tensor, skip: Sequence[tuple[int, int]] = ()) -> Comparison | None:
        """``peer``'s values here against ``recomputed`` (the whole flat vector), less the ``skip``
        ranges (absolute, end excluded); None when ``peer`` sent nothing here."""
        parts = self.shares.get(peer)
        if not parts:
            return None
        sent = torch.cat([p.reshape(-1).float() for p in parts])
        stop = self.start + sent.numel()
        if stop > recomputed.numel():
            return Comparison(sent.numel(), math.inf, 0.0)
        mine = recomputed[self.start:stop].float()
        keep = torch.ones(sent.numel(), dtype=torch.bool)
        for lo, hi in skip:
            lo, hi = max(lo, self.start) - self.start, min(hi, stop) - self.start
            if lo < hi:
                keep[lo:hi] = False
        sent, mine = sent[keep], mine[keep]
        return Comparison(int(sent.numel()), float((sent - mine).norm()), float(mine.norm()))
