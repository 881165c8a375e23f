"""hivemind's all-reduce, returning every peer the averaged bytes themselves.

hivemind 1.1.12's ``AllReduceRunner`` sends each peer the *difference* between a part's average
and that peer's own part, which the peer adds back: ``x + (avg - x)`` is the average within a
rounding, not its bytes, so two replicas would step from gradients that differ in the last bit and
drift apart. :class:`ExactAllReduceRunner` changes the two places where hivemind subtracts (the
part this peer reduces itself, and the answer to a peer's part) to send the average, and turns the
part container's deltas off, so every peer of a group ends with the same bytes; a failed part
keeps the peer's own values, as hivemind's zero delta does (and :class:`~.averaging.StageAverager`
then fails the round: its values are not the average). With a lossy part compression
(``replicas.averaging = "fp16"``) a reducer answers every peer in that compression, whatever a
peer's parts came in, and keeps for itself its average as the peers decode it. The two methods
are hivemind 1.1.12's with those changes (hivemind is pinned: ``pyproject.toml``); every peer of a
group must run this runner (a stage's replicas all run :class:`~.averaging.StageAverager`). It also counts the tensor
bytes it sends and receives (``traffic``), what a stage's averaging costs on its links.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from mapl_swarm.replicas.robust import AGGREGATES
from mapl_swarm.replicas.work import KeptParts

__all__ = ["ExactAllReduceRunner", "count_traffic"]

logger = logging.getLogger(__name__)


def count_traffic(traffic: Any, sent: int = 0, received: int = 0) -> None:
    """Add tensor bytes to ``traffic`` (``[sent, received]``, shared with the host process; None:
    not counted)."""
    if traffic is not None:
        with traffic.get_lock():
            traffic[0] += sent
            traffic[1] += received


class RobustPartReducer(TensorPartReducer):
    """hivemind 1.1.12's part reducer, keeping every sender's share of the current part and returning
    ``aggregate`` of them (:mod:`.robust`) instead of the weighted mean."""

    def __init__(self, *args: Any, aggregate: Any, **kwargs: Any) -> None:
        self.aggregate = aggregate
        super().__init__(*args, **kwargs)

    def reset_accumulators(self) -> None:
        self.shares: list[tuple[torch.Tensor, float]] = []
        super().reset_accumulators()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.shares.append((tensor_part, weight))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            # one reducer per part: every member receives its bytes, whatever the arrival order
            self.current_part_future.set_result(self.aggregate([x for x, _ in self.shares],
                                                               [w for _, w in self.shares]))
            self.reset_accumulators()


class ExactAllReduceRunner(AllReduceRunner):
    """An ``AllReduceRunner`` whose output tensors are the averages (module docstring); ``aggregation``
    other than ``"mean"``: each part's reducer returns that robust aggregate (:class:`RobustPartReducer`,
    :data:`~.robust.AGGREGATES`) instead."""

    def __init__(self, *args: Any, traffic: Any = None, aggregation: str = "mean", keep_parts: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept_parts: KeptParts | None = None
        """With ``keep_parts``: every other sender's values of the part this peer reduces, as they
        came (partners check a share against them, :mod:`.work`)."""
        if keep_parts:
            me = self.ordered_peer_ids.index(self.peer_id)
            parts = self.tensor_part_container._input_parts_by_peer  # hivemind 1.1.12's split, contiguous by peer
            start = sum(int(part.numel()) for peer in parts[:me] for part, _ in peer)
            self.kept_parts = KeptParts(start, {})
        if aggregation != "mean":
            reducer = self.tensor_part_reducer
            self.tensor_part_reducer = RobustPartReducer(reducer.part_shapes, reducer.num_senders,
                                                         aggregate=AGGREGATES[aggregation])
        self.tensor_part_container.return_deltas = False  # outputs are averages; a failed part keeps its own
        self.traffic = traffic
        """Tensor bytes sent and received, ``[sent, received]`` (shared with the host process; None: not counted)."""
        self.failed_reducers: set[PeerID] = set()
        """Members whose averaged part did not come back (with hivemind's ``banned_senders``, whose
        parts did not come: who broke a failed round, as this member saw it)."""

    def _encode(self, averaged: torch.Tensor) -> Any:
        """An averaged part as it is sent back: in this round's part compression."""
        return self.tensor_part_container.compression.compress(averaged, CompressionInfo.from_tensor(averaged))

    def _as_sent(self, averaged: torch.Tensor) -> torch.Tensor:
        """An averaged part as the peers decode it (itself, without lossy compression)."""
        if isinstance(self.tensor_part_container.compression, NoCompression):
            return averaged
        return deserialize_torch_tensor(self._encode(averaged))

    def _count(self, sent: int = 0, received: int = 0) -> None:
        count_traffic(self.traffic, sent, received)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._count(sent=message.tensor_part.ByteSize())
            yield message

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight)
                self.tensor_part_container.register_processed_part(peer_index, part_index,
                                                                   self._as_sent(averaged_part))
            return
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            def deserialize(msg: averaging_pb2.AveragingData) -> tuple[Any, averaging_pb2.AveragingData]:
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                self._count(received=msg.tensor_part.ByteSize())
                return deserialize_torch_tensor(msg.tensor_part), msg

            part_index = 0
            async for averaged, _msg in amap_in_executor(deserialize, aiter_with_timeout(stream, self.reducer_timeout),
                                                         max_prefetch=self.tensor_part_container.prefetch):
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != self.tensor_part_container.num_parts_by_peer[peer_index]:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected "
                                         f"{self.tensor_part_container.num_parts_by_peer[peer_index]}")
        except BaseException as e:
            if isinstance(e, Exception):
                # the round fails (its values are not the average): say why; on a busy link it is not always a death
                logger.warning("all-reduce with %s failed: %r", peer_id, e)
            self.failed_reducers.add(peer_id)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            def deserialize(msg: averaging_pb2.AveragingData) -> tuple[Any, float, Any]:
                self._count(received=msg.tensor_part.ByteSize())
                return deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression

            async for tensor_part, weight, _ in amap_in_executor(
                    deserialize, stream, max_prefetch=self.tensor_part_container.prefetch):
                if self.kept_parts is not None:
                    self.kept_parts.shares.setdefault(self.sender_peer_ids[sender_index].to_base58(),
                                                      []).append(tensor_part)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight)
                    part_index += 1
                except BannedException:
                    break  # the sender was banned: its parts are no longer aggregated
                serialized = await loop.run_in_executor(None, self._encode, averaged_part)
                self._count(sent=serialized.ByteSize())
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
