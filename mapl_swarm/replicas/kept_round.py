"""A round whose all-reduce broke at one member after a partner kept it: that member takes the
partner's result instead of failing.

hivemind's all-reduce ends separately at each member. A member whose stream from a partner's
reducer breaks after that partner has every part it needs (seen about once in 2,400–5,000 rounds
on a loaded 2-core host: "peer X sent 6 parts, but we expected 7") fails while the partner keeps
the round; this member cannot tell, so the whole swarm would redo the step (SPEC §9.10 item 6).
Every member that keeps a round holds the group's averaged bytes (:mod:`.exact_allreduce`), so the
one that failed asks its partners for them (``rpc_kept_round``, members of that group only): a
partner answers once its own all-reduce of that group ended, with its averaged tensors if it kept
the round, with "failed too" (:data:`FAILED_TOO`) if its all-reduce of that group failed as well
or never began (its own matchmaking gave up before the leader's group began), and with a refusal
(``CANCELLED``) if it cannot say (it has since begun filling its tensors for another round, or its
all-reduce did not end in time). The first partner that kept it gives this
member the same bytes, and its round counts (in a group of 3 or more, the first two partners that
give the same bytes: :func:`agreed`). When every partner failed too, nobody kept the round, so every
member runs it again from the same gradients, as a round that failed before its all-reduce began
(no step is redone); otherwise this member cannot tell (``unsure``) and the step is redone.

:class:`Outcomes` is the keeping side's record (in the averager process), :func:`parts` and
:func:`take` the answer's stream of serialized tensors (hivemind's chunks) and its checked reading.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import NamedTuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from mapl_swarm.aio import within

__all__ = ["Outcome", "Outcomes", "FailedToo", "parts", "take", "paced", "agreed", "KEPT_GROUPS", "CHUNK_BYTES",
           "FAILED_TOO", "OUTCOME_PARTS"]

KEPT_GROUPS = 4
"""Groups whose outcome an averager remembers (the current round's, and a few before it)."""
CHUNK_BYTES = 1 << 19
"""Bytes of a tensor per message of an answer (hivemind's all-reduce parts are as large)."""
SEEN_GROUPS = 1024
"""Groups whose all-reduce began here that an averager remembers by id (it answers "not kept" about
any other)."""
OUTCOME_PARTS = 4
"""An asked member waits for its own all-reduce of the group to end up to this many part timeouts
(hivemind's ``next_chunk_timeout``): a partner whose stream broke ends its all-reduce up to twice
that after its last part came (its reducers' answers), and the asker must hear how it ended."""
FAILED_TOO = averaging_pb2.GROUP_DISBANDED
"""The answer's code when the asked member's all-reduce of that group failed too (one message)."""


class Outcome(NamedTuple):
    """How a member's all-reduce of a group ended: ``kept`` (with every averaged value), its tensors
    then at ``fill`` (-1 when it failed)."""

    kept: bool
    fill: int


class FailedToo(Exception):
    """The asked partner's all-reduce of that group failed too (it answered :data:`FAILED_TOO`)."""


class Outcomes:
    """Whether this member kept each of its last :data:`KEPT_GROUPS` groups' all-reduce, and at which
    fill of its tensors (a result is served only while the tensors still hold it)."""

    def __init__(self) -> None:
        self._ended: OrderedDict[bytes, tuple[asyncio.Future[int | None], frozenset[PeerID]]] = OrderedDict()
        """Each remembered group's end: the fill at which this member kept it, or None (it failed)."""
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        """The last :data:`SEEN_GROUPS` groups whose all-reduce began here (a group asked about that
        is not among them never began here)."""
        self._waiters: list[asyncio.Future[None]] = []

    def began(self, group_id: bytes, members: Sequence[PeerID]) -> None:
        """This member's all-reduce of ``group_id`` among ``members`` began."""
        self._ended[group_id] = (asyncio.get_running_loop().create_future(), frozenset(members))
        while len(self._ended) > KEPT_GROUPS:
            self._ended.popitem(last=False)
        self._seen[group_id] = None
        while len(self._seen) > SEEN_GROUPS:
            self._seen.popitem(last=False)
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def ended(self, group_id: bytes, kept: bool, fill: int = -1) -> None:
        """That all-reduce ended; ``kept``: with every averaged value, its tensors at ``fill``."""
        entry = self._ended.get(group_id)
        if entry is not None and not entry[0].done():
            entry[0].set_result(fill if kept else None)

    def ran(self, group_id: bytes) -> bool:
        """This member's all-reduce of ``group_id`` began (so a partner may have kept it)."""
        return group_id in self._ended

    async def outcome(self, group_id: bytes, asker: PeerID, timeout: float, *,
                      unknown_s: float = 0.0) -> Outcome | None:
        """How this member's all-reduce of ``group_id`` ended, for ``asker``, a member of that group,
        once it ended (``timeout`` s at most); None when it did not end within that, or when
        ``asker`` is no member of a group this member remembers. A group whose all-reduce does not
        begin here within ``unknown_s`` was not kept here (the leader counted this member in, but its
        own matchmaking gave up before the group began: it will not join that group any more)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + unknown_s
        while group_id not in self._seen:
            left = deadline - loop.time()
            if left <= 0:
                return Outcome(False, -1)
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            with contextlib.suppress(TimeoutError):
                await within(waiter, left)
        entry = self._ended.get(group_id)
        if entry is None or asker not in entry[1]:
            return None
        try:
            fill = await within(asyncio.shield(entry[0]), timeout)
        except TimeoutError:
            return None
        return Outcome(False, -1) if fill is None else Outcome(True, fill)


def agreed(answers: Sequence[tuple[PeerID, Sequence[torch.Tensor]]], group_size: int) -> list[PeerID] | None:
    """The partners whose kept results this member takes, given ``answers`` so far (partner,
    tensors; the last one just came): in a group of 2 its only partner's; in a larger one two
    partners' giving the same bytes (the last and an earlier one), since a member that broke this
    one's all-reduce on purpose could otherwise hand it any result; None when not yet."""
    if not answers:
        return None
    peer, got = answers[-1]
    if group_size <= 2:
        return [peer]
    for other, earlier in answers[:-1]:
        if len(earlier) == len(got) and all(torch.equal(a, b) for a, b in zip(earlier, got)):
            return [other, peer]
    return None


def parts(tensors: Sequence[torch.Tensor]) -> Iterator[averaging_pb2.AveragingData]:
    """The answer to a partner: ``tensors`` as hivemind's chunks of serialized tensors (a tensor's
    first chunk carries its dtype)."""
    for tensor in tensors:
        for chunk in split_for_streaming(serialize_torch_tensor(tensor), CHUNK_BYTES):
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=chunk)


async def paced(answer: AsyncIterator[averaging_pb2.AveragingData], first_s: float,
                next_s: float) -> AsyncIterator[averaging_pb2.AveragingData]:
    """``answer``'s messages, the first within ``first_s`` (the asked member waits for its outcome),
    each next within ``next_s`` (a large answer on a slow link takes as long as it takes, a stalled
    one fails); raises :class:`TimeoutError`."""
    messages = aiter(answer)
    timeout = first_s
    while True:
        try:
            message = await within(anext(messages), timeout)
        except StopAsyncIteration:
            return
        yield message
        timeout = next_s


async def take(answer: AsyncIterator[averaging_pb2.AveragingData], like: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """The tensors of a partner's answer, when it kept the round and they have the shapes and dtypes
    of ``like`` (this member's, read for those only); None otherwise. Raises :class:`FailedToo` when
    the partner's all-reduce failed too. Reads no more than a MiB over what ``like`` holds."""
    limit = sum(t.numel() * t.element_size() for t in like) + (1 << 20)
    got: list[torch.Tensor] = []
    chunks: list = []
    size = 0

    def close() -> bool:
        if chunks:
            got.append(deserialize_torch_tensor(combine_from_streaming(chunks)))
            chunks.clear()
            i = len(got) - 1
            return i < len(like) and got[i].shape == like[i].shape and got[i].dtype == like[i].dtype
        return True

    async for message in answer:
        if message.code == FAILED_TOO and not got and not chunks:
            raise FailedToo("the partner's all-reduce of the group failed too")
        if message.code != averaging_pb2.AVERAGED_PART:
            return None
        size += len(message.tensor_part.buffer)
        if size > limit:
            return None
        if message.tensor_part.dtype and not close():
            return None
        chunks.append(message.tensor_part)
    if not close() or len(got) != len(like):
        return None
    return got
