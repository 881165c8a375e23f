"""Members-only averaging among the replicas of one stage, through hivemind's ``DecentralizedAverager``.

The replicas of stage k of a run share one averager prefix (:func:`~mapl_swarm.net.discovery.averaging_prefix`)
and therefore hivemind's matchmaking key ``<prefix>.0b`` and state-download key
``<prefix>.all_averagers``. hivemind 1.1.12's averager authorizes nobody: any process that reaches
its p2p daemon can join matchmaking, contribute a part of the average or download the state. Here
every averager RPC (``rpc_join_group``, ``rpc_aggregate_part``, ``rpc_download_state``,
``rpc_kept_round`` of :mod:`.kept_round` and ``rpc_work_inputs`` of :mod:`.work`) is served only to
a **member**: a peer whose libp2p peer id is a subkey of the stage's ``all_averagers`` key and
that the stage's rounds did not exclude.
A certified DHT node accepts a record under that key only when the certificate it carries allows
stage k and the subkey is the peer id of the certificate's own signing key
(:class:`~mapl_swarm.net.dht_validation.CertifiedRecordValidator`, member keys), and libp2p proves a
connection's peer id, so a member is a certified, unrevoked replica of this stage. A group that the
leader assembled with anyone else is refused before a byte of this replica's tensors is sent. The
all-reduce returns every member the averaged bytes (:mod:`.exact_allreduce`), so replicas that
average the same gradients hold the same parameters, bit for bit.

Every replica declares itself under ``all_averagers`` from its start (hivemind does, when it shares
state), so a joining replica becomes a member as soon as its record is stored. The replica's DHT node
must run with the identity derived from its peer key (:meth:`~mapl_swarm.net.identity.PeerKey.libp2p_private_key`;
:class:`~mapl_swarm.net.discovery.Discovery` starts a certified peer's node so), and the averager
forks a process: create it before ZeroMQ, the event loop and torch threads, as the DHT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, AsyncIterator, Callable  # typing's: hivemind reads the RPC hints by their _name

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.compression import NoCompression, deserialize_torch_tensor
from hivemind.utils import MPFuture, ValueWithExpiration, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip, enter_asynchronously
from hivemind.utils.streaming import combine_from_streaming

from mapl_swarm.aio import within
from mapl_swarm.net.discovery import averaging_prefix, member_keys
from mapl_swarm.procs import set_parent_death_signal, watch_parent
from mapl_swarm.replicas import kept_round, work
from mapl_swarm.replicas.exact_allreduce import ExactAllReduceRunner, count_traffic
from mapl_swarm.replicas.members import DIAL_OUT_PRIORITY, group_refusal, member_records
from mapl_swarm.replicas.schemes import (LowRank, Sparse, check_share, orthonormal, part_compression, product,
                                         sparse_share, sparse_sum)
from mapl_swarm.replicas.state import StateMismatch, flatten_state, restore_like

__all__ = ["StageAverager", "NobodyKept", "REFUSALS", "MEMBERS_CACHE_S", "GATHER_ONLY", "Usable"]

logger = logging.getLogger(__name__)

REFUSALS = ("join_group", "aggregate_part", "download_state", "kept_round", "work_inputs", "sparse_share", "group")
"""What a stage averager refuses to a non-member: its six RPCs, and a group assembled with one."""
STATE_KEY = "mapl_stage_state"
"""The metadata key of a stage state in a download (hivemind's own metadata is a dict too)."""
GATHER_ONLY = "gather_only"
"""A member whose gathered data (a dict) holds this key with ``True`` makes its round gather only:
matchmaking and the gathered data, no all-reduce (the sync round before the first step averages
nothing; a round whose all-reduce broke at one member and not at another could split them)."""
Usable = Callable[[dict[str, Any]], bool]
"""Whether a round whose members gathered this (peer id as text -> gathered data) can count: one it
cannot runs no all-reduce (as :data:`GATHER_ONLY`), so a doomed round sends no tensor bytes."""


class NobodyKept(MatchmakingException):
    """A round whose all-reduce broke at every member of its group (each one's partners said so
    through ``kept_round``): nobody applied it, so its members run it again from the same gradients
    instead of redoing the step."""


PHASES = (b".P", b".Q")
"""The suffixes of a PowerSGD round's two all-reduces' group ids (after the group's own id)."""
HALF_PHASES = (b".H", b".X")
"""The suffixes of an ``fp16`` round's group ids: its all-reduce in float16, its exact one."""
SPARSE_PHASES = (b".S", b".X")
"""The suffixes of a ``topk`` round's group ids: its all-gather of sparse shares, its all-reduce of
the exact tensors."""
MEMBERS_CACHE_S = 1.0
"""How long a read of the stage's members is reused before the DHT is asked again."""
MEMBERS_REREAD_S = 0.2
"""A request from an unknown peer reads the members again, at most this often (a stranger's flood
of requests costs no more DHT reads than that)."""
MEMBER_RECORD_PERIODS = 3
"""A replica's ``all_averagers`` record lives this many ``declare_state_period`` s and is renewed
every period: hivemind's lives exactly one period, so a renewal delayed by a busy link (averaging
bytes queued ahead of the DHT's) left a gap in which the replica's partners refused it as a stranger."""

PART_TIMEOUT_S = 20.0
"""hivemind's ``next_chunk_timeout``: a member whose first or next part of an all-reduce (512 KiB,
about 1 s at 4 Mbit/s) does not come within this many seconds is banned from the round, which then
fails (its reducers' results: twice that). Without it a member that left matchmaking just as the
round began kept its partners waiting for parts that never come, up to the whole
``replicas.averaging_timeout_s``; a state download's chunks wait as long."""


class StageAverager(DecentralizedAverager):
    """The averager of one replica of ``stage`` in ``run_id``, serving members only (module docstring).

    ``replicas``: how many replicas a step averages among (hivemind's ``target_group_size``: a
    group forms as soon as that many are in, without waiting ``min_matchmaking_time`` out).
    ``aggregation``: ``"mean"`` (weighted), ``"centered_clip"`` or ``"trimmed_mean"`` (:mod:`.robust`, per part).
    ``scheme``: ``replicas.averaging`` (:mod:`.schemes`); with ``powersgd``, ``low_rank`` says
    which averaged tensors are compressed, and the averaged tensors end with one warm-start factor
    Q per compressed matrix, which only the rounds write; with ``topk``, ``sparse`` says which
    are sent sparse; with ``fp16``, ``half`` which cross in float16.
    ``state``: the stage's whole state (:mod:`.state`), what :meth:`download_state` of a joining
    replica receives. A round in which a member gathered :data:`GATHER_ONLY` runs no all-reduce and
    leaves the tensors as they are; so does one that ``usable`` (:data:`Usable`, called in the
    averager process with what every member gathered) refuses. Everything else is hivemind's
    (``averaged_tensors``, ``dht``, ``start``, ``step(weight=...)``)."""

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, run_id: str, stage: int,
                 replicas: int, aggregation: str = "mean", scheme: str = "fp32", low_rank: LowRank | None = None,
                 sparse: Sparse | None = None, half: Sequence[int] | None = None,
                 state: Callable[[], Any] | None = None,
                 usable: Usable | None = None, inputs: work.InputsOf | None = None,
                 min_matchmaking_time: float = 2.0, request_timeout: float = 1.0, declare_state_period: float = 10.0,
                 next_chunk_timeout: float = PART_TIMEOUT_S, **kwargs: Any) -> None:
        if replicas < 2:
            raise ValueError(f"averaging needs at least 2 replicas, got {replicas}")
        self.run_id, self.stage = run_id, stage
        self.aggregation = aggregation
        """``replicas.aggregation``: the weighted mean, or a robust aggregate per part (:mod:`.robust`)."""
        if (scheme == "powersgd") != (low_rank is not None) or (scheme == "topk") != (sparse is not None) or \
                (scheme == "fp16") != (half is not None):
            raise ValueError(f"averaging scheme {scheme!r} with low-rank plan {low_rank!r}, sparse plan {sparse!r} "
                             f"and float16 tensors {half!r}")
        self.scheme, self._low_rank, self._sparse = scheme, low_rank, sparse
        self._half = None if half is None else tuple(half)
        self._shares: OrderedDict[bytes, tuple[asyncio.Future, frozenset[PeerID]]] = OrderedDict()
        """``topk``: this member's sparse share of its last :data:`~.kept_round.KEPT_GROUPS` groups
        (the averager process's): a partner may ask for it after this member's round ended."""
        self._weights: dict[PeerID, float] = {}
        """Each member's weight in the round running: the micro-batches it gathered (``topk``
        checks a share's weight against it)."""
        self._share_culprits: set[PeerID] = set()
        self._share_wrong = False
        """``topk``: a share of the last round came wrong (not merely late): its round fails here
        without asking a partner for the result (the sender of a wrong share would be one)."""
        """``topk``: the members whose shares did not come, or came wrong, in the last round."""
        self._runner: ExactAllReduceRunner | None = None
        """The all-reduce running or last run (who broke it, when it failed)."""
        self._state = state
        """What a joining replica downloads: the stage's state, read in this (the host) process."""
        self._usable = usable
        self._checking = inputs is not None
        """Replicas check each other's work (:mod:`.work`): this member keeps the parts it reduced
        of its partners' shares for :data:`work.KEPT_ROUNDS` rounds and serves its inputs."""
        self._kept_parts: dict[tuple[int, int], work.KeptParts] = {}  # the averager process's
        self._excluded: set[PeerID] = set()  # the averager process's: members whose work failed
        self._round_key: tuple[int, int] | None = None
        self._work_pipe = work.serve_inputs(inputs) if inputs is not None else None
        self._members_key = member_keys(run_id, stage)[1]
        self._members: frozenset[PeerID] = frozenset()
        self._members_read = -float("inf")
        self._refusals = mp.Array("q", len(REFUSALS))  # shared: the RPCs are served in the averager's process
        self._traffic = mp.Array("q", 2)  # tensor bytes sent, received by its all-reduces (that process too)
        self._culprits = mp.Array("c", 4096)  # who broke its last all-reduce, if it failed (that process too)
        self._fills = mp.Value("q", 0)  # how often the host filled the tensors for a round
        self._outcomes = kept_round.Outcomes()  # the averager process's (kept_round)
        self._refused_logged: set[tuple[str, PeerID]] = set()
        self._dial_out: frozenset[PeerID] = frozenset()
        """The members that declared :data:`DIAL_OUT_PRIORITY`: nobody dials them (state downloads ask them last)."""
        self._serving = False  # the averager process's: a dial-out member's handlers are registered
        dial_out = dht.client_mode if kwargs.get("client_mode") is None else bool(kwargs["client_mode"])
        super().__init__(averaged_tensors, dht, prefix=averaging_prefix(run_id, stage), target_group_size=replicas,
                         min_group_size=2, initial_group_bits="", min_matchmaking_time=min_matchmaking_time,
                         request_timeout=request_timeout, declare_state_period=declare_state_period,
                         next_chunk_timeout=next_chunk_timeout, allow_state_sharing=not dial_out, **kwargs)
        if dial_out:  # it serves its state over its own connections (hivemind's setter refuses client mode)
            self._allow_state_sharing.value = True

    def start(self) -> None:
        self._parent_pid_seen = os.getpid()
        self._forked_on_main_thread = threading.current_thread() is threading.main_thread()
        super().start()

    def run(self) -> None:
        """The averager process (forked): it dies with the peer (even a SIGKILLed one: it holds
        nothing of the run's state), has one torch thread, since the peer may have started its
        OpenMP threads before the fork, which leaves the child none of them to use, and leaves the
        logging of failed rounds to the host process."""
        parent = self._parent_pid_seen
        if not (self._forked_on_main_thread and set_parent_death_signal(signal.SIGKILL, parent_pid=parent)):
            watch_parent(parent, lambda: os.kill(os.getpid(), signal.SIGKILL))
        torch.set_num_threads(1)
        # a failed round is the caller's to log (ReplicaGradients names it); hivemind would log each
        # attempt that found no group with its traceback, every few seconds while a partner is late
        logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
        super().run()

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind's, in the averager process, when the DHT node whose p2p daemon it shares stopped
        first (the order a peer stops in: an averager gone first leaves the DHT node requests it
        cannot read, and the node then waits out its shutdown timeout): its handlers went with the
        daemon, so removing them fails, and nothing else is left to do but its groups."""
        try:
            if not self.client_mode or self._serving:
                await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        except OSError:
            logger.debug("stage %d averaging: the p2p daemon stopped before the averager", self.stage)
        remaining: set[Any] = set()
        for group in self._running_groups.values():
            remaining.update(group.finalize(cancel=True))
        await within(asyncio.gather(*remaining), timeout)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """hivemind's, minus its side effect on this process: hivemind 1.1.12 sets SIGINT to
        ``SIG_IGN`` in the *calling* process before it forks the averager (meaning the child), which
        would leave the host peer deaf to Ctrl-C and every process it starts later ignoring SIGINT
        (Python installs no KeyboardInterrupt handler in a process started with SIGINT ignored).
        The averager process still starts with SIGINT ignored; this one gets its handler back."""
        previous = signal.getsignal(signal.SIGINT)
        try:
            super().run_in_background(await_ready=False)
        finally:
            signal.signal(signal.SIGINT, previous)
        if self.client_mode:
            self._outer_pipe.send(("_serve_dial_out", [], {}))  # run once the averager process is ready
        if await_ready:
            self.wait_until_ready(timeout)

    async def _serve_dial_out(self) -> None:
        """A dial-out member's averager (hivemind's client mode, in which it registers no handler
        and declares nothing): it serves its partners over the connections it opened to them (a
        partner asking for a kept round, a sparse share or its inputs reaches it there) and declares
        itself a member with :data:`DIAL_OUT_PRIORITY`. It still leads no group and reduces no part:
        hivemind's client mode, which its partners accept (:meth:`_aggregate_with_group`)."""
        await self.add_p2p_handlers(self._p2p, namespace=self.prefix)
        self._serving = True
        asyncio.create_task(self._declare_for_download_periodically())

    @contextlib.contextmanager
    def filling(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged tensors, for the host to fill for its next round: a result kept for a
        partner (:mod:`.kept_round`) is no longer served from them."""
        with self.get_tensors() as tensors:
            with self._fills.get_lock():
                self._fills.value += 1
            yield tensors

    @property
    def traffic(self) -> tuple[int, int]:
        """Tensor bytes this replica's all-reduces sent and received so far (protobuf-serialized parts)."""
        with self._traffic.get_lock():
            return int(self._traffic[0]), int(self._traffic[1])

    @property
    def culprits(self) -> list[str]:
        """The members (peer ids as text) whose parts, or averaged parts, did not come in this
        member's last all-reduce, when it failed (empty after one that completed)."""
        raw = self._culprits.value.decode()
        return [p for p in raw.split(",") if p]

    @property
    def refused(self) -> dict[str, int]:
        """Requests refused so far, by what was refused (:data:`REFUSALS`), in either process."""
        return {name: int(self._refusals[i]) for i, name in enumerate(REFUSALS)}

    def set_group_size(self, replicas: int) -> None:
        """Form the next rounds' groups as soon as ``replicas`` members are in (hivemind's
        ``target_group_size``, in the averager process): the stage's live replicas change as
        replicas leave and join."""
        if replicas < 1:
            raise ValueError(f"a group of {replicas} replicas")
        self._outer_pipe.send(("_set_group_size", [int(replicas)], {}))

    async def _set_group_size(self, replicas: int) -> None:
        """:meth:`set_group_size` in the averager process; the pipe's calls run in order, so a step
        sent after it forms its group with this size."""
        matchmaking = self._matchmaking
        matchmaking.target_group_size = matchmaking.potential_leaders.target_group_size = replicas
        matchmaking.group_key_manager.target_group_size = replicas  # it draws a member's group bits among them

    # ------------------------------------------------------------------ membership
    async def members(self, *, fresh: bool = False) -> frozenset[PeerID]:
        """The stage's members: the peer ids under its ``all_averagers`` key (certified records only),
        read again after :data:`MEMBERS_CACHE_S` (``fresh``: after :data:`MEMBERS_REREAD_S`)."""
        age = time.monotonic() - self._members_read
        if age > MEMBERS_CACHE_S or (fresh and age > MEMBERS_REREAD_S):
            found = await self.dht.get(self._members_key, latest=True, return_future=True)
            entries = found.value if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict) else {}
            self._members, self._dial_out = member_records(entries)
            self._members_read = time.monotonic()
        return self._members

    def exclude(self, peer: str) -> None:
        """Refuse member ``peer`` (peer id as text) from now on, as a non-member: the stage's rounds
        found its work wrong (:mod:`.work`)."""
        self._outer_pipe.send(("_exclude", [peer], {}))

    async def _exclude(self, peer: str) -> None:
        self._excluded.add(PeerID.from_base58(peer))

    async def _is_member(self, peer: PeerID, rpc: str) -> bool:
        if peer != self.peer_id and peer in self._excluded:
            pass  # refused below, as a stranger
        elif peer == self.peer_id or peer in await self.members() or peer in await self.members(fresh=True):
            return True
        with self._refusals.get_lock():
            self._refusals[REFUSALS.index(rpc)] += 1
        if (rpc, peer) not in self._refused_logged:
            if len(self._refused_logged) >= 1024:
                self._refused_logged.clear()  # bounded memory: a stranger may be logged twice
            self._refused_logged.add((rpc, peer))
            logger.warning("stage %d averaging: refused %s from %s, not a certified replica of this stage",
                           self.stage, rpc, peer)
        return False

    # ------------------------------------------------------------------ hivemind RPCs, members only
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._is_member(context.remote_id, "join_group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._is_member(context.remote_id, "aggregate_part"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._is_member(context.remote_id, "download_state"):
            return  # an empty answer: hivemind's downloader moves on to the next peer
        async for message in super().rpc_download_state(request, context):
            yield message

    async def rpc_kept_round(self, request: averaging_pb2.AveragingData,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A partner whose all-reduce of group ``request.group_id`` broke asks for this member's result
        (:mod:`.kept_round`): the averaged tensors if this member kept that round, else a refusal."""
        if not await self._is_member(context.remote_id, "kept_round"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        outcome = await self._outcomes.outcome(request.group_id, context.remote_id,
                                               kept_round.OUTCOME_PARTS * self.next_chunk_timeout,
                                               unknown_s=self.next_chunk_timeout)
        if outcome is not None and not outcome.kept:
            yield averaging_pb2.AveragingData(code=kept_round.FAILED_TOO)
            return
        answer: list[averaging_pb2.AveragingData] = []
        if outcome is not None:
            async with enter_asynchronously(self.get_tensors()) as tensors:
                if self._fills.value == outcome.fill:  # not filled for another round since
                    answer = list(await asyncio.get_running_loop().run_in_executor(
                        None, lambda: list(kept_round.parts(tensors))))
        if not answer:
            yield averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
        count_traffic(self._traffic, sent=sum(m.tensor_part.ByteSize() for m in answer))  # a round's bytes too
        for message in answer:
            yield message

    async def _take_kept(self, group_info: GroupInfo, *, take: bool = True) -> list[PeerID] | None:
        """This member's all-reduce of ``group_info`` broke: the averaged tensors of the partners
        that kept the round, written into this member's once as many as :func:`~.kept_round.agreed`
        asks gave the same bytes (``take`` False: none is taken); those partners, or None when too
        few did. Raises :class:`NobodyKept` when every partner answered that its all-reduce of the
        group failed too."""
        answers: list[tuple[PeerID, list[torch.Tensor]]] = []
        failed_too = 0
        partners = [peer for peer in group_info.peer_ids if peer != self.peer_id]
        for peer in partners:
            try:
                stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
                async with enter_asynchronously(self.get_tensors()) as tensors:  # shapes and dtypes only
                    like = list(tensors)
                answer = await stub.rpc_kept_round(averaging_pb2.AveragingData(group_id=group_info.group_id))
                got = await kept_round.take(kept_round.paced(
                    answer, (kept_round.OUTCOME_PARTS + 1) * self.next_chunk_timeout, self.next_chunk_timeout), like)
            except kept_round.FailedToo:
                failed_too += 1
                continue
            except Exception as exc:  # a partner gone, or a broken answer: ask the next one
                logger.debug("stage %d averaging: no kept round from %s: %r", self.stage, peer, exc)
                continue
            if got is None:
                continue
            count_traffic(self._traffic, received=sum(t.numel() * t.element_size() for t in got))
            answers.append((peer, got))
            givers = kept_round.agreed(answers, len(group_info.peer_ids)) if take else None
            if givers is not None:
                async with enter_asynchronously(self.get_tensors()) as tensors:
                    for tensor, averaged in zip(tensors, got):
                        tensor.copy_(averaged)
                return givers
        if partners and failed_too == len(partners):
            raise NobodyKept(f"stage {self.stage}: the all-reduce broke at every member of the group, so none "
                             f"applied it")
        return None

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        strangers = [p for p in group_info.peer_ids if not await self._is_member(p, "group")]
        if strangers:
            raise MatchmakingException(f"a group with {len(strangers)} peer(s) that are no replicas of stage "
                                         f"{self.stage}: {strangers}")
        try:
            declared = {peer: self.serializer.loads(blob) for peer, blob in zip(group_info.peer_ids, group_info.gathered)}
            gathered = {peer: self.serializer.loads(d[2]) for peer, d in declared.items()}
        except Exception as exc:  # hivemind's own would fail alike: the round fails
            raise MatchmakingException(f"unreadable gathered data: {type(exc).__name__}: {exc}") from None
        refusal = group_refusal(declared, self._dial_out, sparse=self._sparse is not None)
        if refusal is not None:
            raise MatchmakingException(refusal)
        if any(isinstance(v, dict) and v.get(GATHER_ONLY) is True for v in gathered.values()) or (
                self._usable is not None and not self._usable({str(p): v for p, v in gathered.items()})):
            # every member reads the same gathered data, so all of them skip the all-reduce alike
            for group_id in self._group_ids(group_info):
                self._running_groups[group_id].cancel()  # no runner: no part is sent or awaited
            return gathered
        mine = gathered.get(self.peer_id)
        self._round_key = work.round_key(mine) if self._checking else None
        self._weights = {peer: float(len(v["micro"])) for peer, v in gathered.items()
                         if isinstance(v, dict) and isinstance(v.get("micro"), list)}
        try:
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        except MatchmakingException as exc:
            if not self._outcomes.ran(group_info.group_id):
                raise
            try:  # a member that sent a wrong share is not asked for the round's result, only whether it kept it
                kept_by = await self._take_kept(group_info, take=not self._share_wrong)
            except NobodyKept as nobody:
                raise NobodyKept(f"{nobody} ({exc})") from None
            if kept_by is None:
                raise
            logger.warning("stage %d averaging: the all-reduce broke here after it began (%s); took the round's "
                           "result from %s, which kept it", self.stage, exc, " and ".join(map(str, kept_by)))
            return gathered

    def _group_ids(self, group_info: GroupInfo) -> list[bytes]:
        """The ids of the all-reduces one round of ``group_info`` runs: the group's own, or with
        PowerSGD one per phase (:data:`PHASES`)."""
        if self._low_rank is not None:
            return [group_info.group_id + phase for phase in PHASES]
        if self._sparse is not None:
            return [group_info.group_id + SPARSE_PHASES[1]]
        if self._half is not None:
            return [group_info.group_id + phase for phase in HALF_PHASES]
        return [group_info.group_id]

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo) -> Iterator[None]:
        """hivemind's, registering each of the round's all-reduces (:meth:`_group_ids`), as its
        ``PowerSGDGradientAverager`` does."""
        ids = self._group_ids(group_info)
        share_id = group_info.group_id + SPARSE_PHASES[0]
        try:
            for group_id in ids:
                self._running_groups[group_id] = asyncio.Future()
            if self._sparse is not None:
                self._shares[share_id] = (asyncio.get_running_loop().create_future(), frozenset(group_info.peer_ids))
                while len(self._shares) > kept_round.KEPT_GROUPS:
                    self._shares.popitem(last=False)
            self._pending_groups_registered.set()
            yield
        finally:
            for group_id in ids:
                self._running_groups.pop(group_id, None)
            share = self._shares.get(share_id)
            if share is not None and not share[0].done():
                share[0].cancel()  # this member made none: an asker is refused at once
            self._pending_groups_registered.set()

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        """The round's all-reduce with :class:`~.exact_allreduce.ExactAllReduceRunner` (every replica
        of the group ends with the same bytes; hivemind's adds a difference back, which rounds), or
        PowerSGD's two (:meth:`_low_rank_round`), or top-k's all-gather (:meth:`_sparse_round`)."""
        group_id = group_info.group_id if group_id is None else group_id
        key, self._round_key = self._round_key, None
        self._runner = None
        self._share_culprits, self._share_wrong = set(), False
        self._outcomes.began(group_id, group_info.peer_ids)
        try:
            if self._low_rank is not None:
                runner = await self._low_rank_round(tensors, group_info, group_id, **kwargs)
            elif self._sparse is not None:
                runner = await self._sparse_round(tensors, group_info, group_id, **kwargs)
            elif self._half is not None:
                runner = await self._half_round(tensors, group_info, group_id, **kwargs)
            else:
                runner = await self._allreduce(tensors, group_info, group_id, keep_parts=key is not None, **kwargs)
        except BaseException:
            self._outcomes.ended(group_id, kept=False)
            runner = self._runner
            broke = {p.to_base58() for p in (runner.banned_senders | runner.failed_reducers if runner is not None
                                             else set()) | self._share_culprits if p != self.peer_id}
            self._culprits.value = ",".join(sorted(broke)).encode()[:4095]
            raise
        self._culprits.value = b""
        self._outcomes.ended(group_id, kept=True, fill=self._fills.value)
        if key is not None and runner.kept_parts is not None:
            self._kept_parts[key] = runner.kept_parts
            for old in sorted(self._kept_parts)[:-work.KEPT_ROUNDS]:
                del self._kept_parts[old]

    async def _allreduce(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes, *,
                         keep_parts: bool = False, **kwargs: Any) -> ExactAllReduceRunner:
        """One all-reduce of ``tensors`` among the group, in place; raises unless every value of
        them is the group's average (:meth:`_check_whole`)."""
        self._runner = runner = ExactAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, traffic=self._traffic, aggregation=self.aggregation,
            keep_parts=keep_parts, **kwargs)
        self._running_groups[group_id].set_result(runner)
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        self._check_whole(runner, tensors)
        return runner

    async def _low_rank_round(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes,
                              **kwargs: Any) -> ExactAllReduceRunner:
        """PowerSGD's round (:mod:`.schemes`) on ``tensors``: the host filled M (with its error
        feedback) into the compressed ones, which end as P̂ Q̂ᵀ, the rest exact; the warm-start
        factors (the last tensors) end as Q̂. A round that fails leaves the factors and M as they
        were (the exact tensors may be partly averaged: the host fills them again)."""
        plan = self._low_rank
        assert plan is not None
        kwargs.pop("tensor_infos", None)  # they describe the averaged tensors, not the factors
        filled = len(tensors) - len(plan.matrices)
        factors = tensors[filled:]
        ms = [tensors[i].view(rows, cols) for i, (rows, cols) in zip(plan.matrices, plan.views)]
        ps = [m @ q for m, q in zip(ms, factors)]
        if ps:  # every member has the same plan, so all skip it alike
            await self._allreduce(ps, group_info, group_id + PHASES[0], **kwargs)
        ps = [orthonormal(p) for p in ps]
        qs = [m.t() @ p for m, p in zip(ms, ps)]
        runner = await self._allreduce([*qs, *(tensors[i] for i in plan.exact(filled))], group_info,
                                       group_id + PHASES[1], **kwargs)
        for m, p, q, factor in zip(ms, ps, qs, factors):
            m.copy_(product(p, q))
            factor.copy_(q)
        return runner

    async def _half_round(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes,
                          **kwargs: Any) -> ExactAllReduceRunner | None:
        """``fp16``'s round: the weight matrices' gradients all-reduced in float16, then the exact
        tensors as they are (projector gradients and statistics stay float32, :mod:`.schemes`)."""
        assert self._half is not None
        kwargs.pop("tensor_infos", None)
        kwargs.pop("compression", None)
        half = [tensors[i] for i in self._half]
        exact = [t for i, t in enumerate(tensors) if i not in self._half]
        if half:
            await self._allreduce(half, group_info, group_id + HALF_PHASES[0], compression=part_compression("fp16"),
                                  **kwargs)
        if not exact:
            return None
        return await self._allreduce(exact, group_info, group_id + HALF_PHASES[1], compression=NoCompression(),
                                     **kwargs)

    async def _sparse_round(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes, *,
                            weight: float = 1.0, **kwargs: Any) -> ExactAllReduceRunner | None:
        """``topk``'s round (:mod:`.schemes`) on ``tensors``: the host filled M (with its error
        feedback) into the sparse ones, which end as the members' shares summed, weighted, in the
        group's order; the exact ones are all-reduced. A member whose share does not come, or
        comes malformed or with another weight than the micro-batches it gathered, fails the round
        (and is named among its culprits)."""
        plan = self._sparse
        assert plan is not None
        kwargs.pop("tensor_infos", None)
        mine: list[torch.Tensor] = []
        for i, k in zip(plan.tensors, plan.counts):
            mine.extend(sparse_share(tensors[i], k))
        mine.append(torch.tensor([float(weight)], dtype=torch.float32))
        share_id = group_info.group_id + SPARSE_PHASES[0]
        future, _ = self._shares[share_id]
        future.set_result(mine)
        exact = [tensors[i] for i in plan.exact(len(tensors))]
        runner = await self._allreduce(exact, group_info, group_id + SPARSE_PHASES[1], weight=weight, **kwargs) \
            if exact else None
        theirs = await asyncio.gather(*(self._fetch_share(peer, share_id, mine, tensors)
                                        for peer in group_info.peer_ids if peer != self.peer_id))
        shares = iter(theirs)
        ordered = [mine if peer == self.peer_id else next(shares) for peer in group_info.peer_ids]
        for j, (i, k) in enumerate(zip(plan.tensors, plan.counts)):
            summed = sparse_sum([(s[2 * j], s[2 * j + 1], float(s[-1][0])) for s in ordered], tensors[i])
            tensors[i].copy_(summed)
        return runner

    async def _fetch_share(self, peer: PeerID, share_id: bytes, like: Sequence[torch.Tensor],
                           tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Member ``peer``'s sparse share of the round ``share_id``, checked (:func:`~.schemes.check_share`)."""
        plan = self._sparse
        assert plan is not None
        why = "no share came"
        try:
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            got = await within(kept_round.take(
                await stub.rpc_sparse_share(averaging_pb2.AveragingData(group_id=share_id)), like),
                3 * (self.next_chunk_timeout or PART_TIMEOUT_S))
        except Exception as exc:  # gone, or a broken stream
            got, why = None, f"{type(exc).__name__}: {exc}"
        if got is not None:
            count_traffic(self._traffic, received=sum(t.numel() * t.element_size() for t in got))
            weight = float(got[-1][0])
            problems = [check_share(got[2 * j], got[2 * j + 1], k, tensors[i].numel())
                        for j, (i, k) in enumerate(zip(plan.tensors, plan.counts))]
            gathered = self._weights.get(peer)
            problems += [] if weight == gathered else [f"weight {weight}, not the {gathered} micro-batches it gathered"]
            bad = next((p for p in problems if p is not None), None)
            if bad is None:
                return got
            why, self._share_wrong = bad, True
        self._share_culprits.add(peer)
        raise AllreduceException(f"stage {self.stage}: the sparse share of {peer} cannot be summed: {why}")

    async def rpc_sparse_share(self, request: averaging_pb2.AveragingData,
                               context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member of a ``topk`` round's group asks for this member's sparse share of it
        (``request.group_id``: the group's id and ``.S``), served once this member computed it."""
        if not await self._is_member(context.remote_id, "sparse_share"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if request.group_id not in self._shares:  # the group assembled there before here
            with contextlib.suppress(TimeoutError):
                await within(self._pending_groups_registered.wait(), self.next_chunk_timeout or PART_TIMEOUT_S)
        entry = self._shares.get(request.group_id)
        share = None
        if entry is not None and context.remote_id in entry[1]:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                share = await within(asyncio.shield(entry[0]), self.next_chunk_timeout or PART_TIMEOUT_S)
        if share is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
            return
        count_traffic(self._traffic, sent=sum(t.numel() * t.element_size() for t in share))
        for message in kept_round.parts(share):
            yield message

    def _check_whole(self, runner: ExactAllReduceRunner, tensors: Sequence[torch.Tensor]) -> None:
        """Raise :class:`AllreduceException` unless ``runner`` left ``tensors`` the group's average.
        hivemind keeps this peer's own values for the parts that did not come, and averages the
        parts it reduces without a sender whose stream broke: neither is the group's average, so the
        round fails here (and, through the broken streams, at the other members too)."""
        failed = runner.tensor_part_container.failed_size
        if failed or runner.banned_senders:
            raise AllreduceException(f"{failed} of {runner.tensor_part_container.total_size} averaged values did not "
                                     f"come and {len(runner.banned_senders)} member(s)' parts were left out (a member "
                                     f"left mid-round)")

    async def _declare_for_download_periodically(self) -> None:
        """hivemind's declaration under ``all_averagers`` (a replica always shares its state; a
        dial-out one declares :data:`DIAL_OUT_PRIORITY`), with a record that outlives its renewal
        (:data:`MEMBER_RECORD_PERIODS`); renewed every period and after each round, as hivemind's."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        period = self.declare_state_period
        while True:
            expiration = get_dht_time() + MEMBER_RECORD_PERIODS * period
            asyncio.create_task(within(
                self.dht.store(key, subkey=self.peer_id.to_bytes(),
                           value=DIAL_OUT_PRIORITY if self.client_mode else self.state_sharing_priority,
                               expiration_time=expiration, return_future=True), period))
            self._state_updated.clear()
            try:
                await within(self._state_updated.wait(), period)
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ checking a partner's work (:mod:`.work`)
    async def rpc_work_inputs(self, request: averaging_pb2.AveragingData,
                              context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """A partner checking this member's share of a step asks for the inputs it took in that step
        (``request.group_id``: :func:`work.request`); none kept: an empty answer."""
        if not await self._is_member(context.remote_id, "work_inputs") or self._work_pipe is None:
            return
        asked = work.read_request(request.group_id)
        if asked is None:
            return
        future = MPFuture()
        self._work_pipe.send((*asked, future))
        try:
            got = await within(future, self.next_chunk_timeout or 20.0)
        except Exception as exc:
            logger.warning("stage %d: the host kept no inputs for step %s: %r", self.stage, asked, exc)
            return
        if got is None:
            return
        metadata, tensors = got
        for message in work.answer(self.serializer.dumps(metadata), tensors):
            yield message

    def fetch_inputs(self, peer: str, step: int, epoch: int, *,
                     timeout: float) -> tuple[Any, list[torch.Tensor]] | None:
        """The inputs member ``peer`` (its peer id as text) took in ``step`` of run epoch ``epoch``, as it
        answers (metadata, tensors); None when it answered none. Raises :class:`ConnectionError`
        when no answer came within ``timeout`` s (the member, or the way to it, failed)."""
        future = MPFuture()
        self._outer_pipe.send(("_fetch_inputs", [], dict(peer=peer, step=step, epoch=epoch, timeout=timeout,
                                                         future=future)))
        return future.result(timeout=timeout + 5.0)

    async def _fetch_inputs(self, peer: str, step: int, epoch: int, timeout: float, future: MPFuture) -> None:
        try:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await stub.rpc_work_inputs(averaging_pb2.AveragingData(group_id=work.request(step, epoch)))
            future.set_result(await within(work.receive(stream, self.serializer,
                                                         self.next_chunk_timeout or timeout), timeout))
        except Exception as exc:
            if not future.done():
                future.set_exception(ConnectionError(f"no answer from {peer}: {type(exc).__name__}: {exc}"))

    def compare_share(self, peer: str, step: int, epoch: int, recomputed: torch.Tensor,
                      skip: Sequence[tuple[int, int]] = (), *, timeout: float = 30.0) -> work.Comparison | None:
        """How member ``peer``'s share in the round of ``step`` and ``epoch``, in the part this member
        reduced, differs from ``recomputed`` (the whole flat vector; ``skip``: ranges not compared);
        None when this member kept no part of it."""
        future = MPFuture()
        self._outer_pipe.send(("_compare_share", [], dict(peer=peer, key=(step, epoch), recomputed=recomputed,
                                                          skip=tuple(skip), future=future)))
        return future.result(timeout=timeout)

    async def _compare_share(self, peer: str, key: tuple[int, int], recomputed: torch.Tensor,
                             skip: Sequence[tuple[int, int]], future: MPFuture) -> None:
        kept = self._kept_parts.get(tuple(key))
        future.set_result(None if kept is None else kept.compare(peer, recomputed, skip))

    # ------------------------------------------------------------------ state download (a joining replica)
    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        """hivemind's hook, in the host process: the stage's state as a msgpack skeleton and tensors."""
        if self._state is None:
            return super().get_current_state()
        skeleton, tensors = flatten_state(self._state())
        return {STATE_KEY: skeleton}, tensors, None

    def download_state(self, like: Any, *likes: Any, timeout: float, sources: Sequence[str] = ()) -> Any | None:
        """The stage's state from a live replica, checked against ``like`` (this replica's own state:
        :func:`~.state.restore_like`), else against each of ``likes`` (other forms it may have);
        None when no replica answered. A state that fits none raises :class:`~.state.StateMismatch`
        (``like``'s). ``sources``: only these members (peer ids as text; a re-sync's, those holding
        the stage's digest); none given: any member."""
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future,
                                                                  sources=tuple(sources))))
        got = future.result(timeout=timeout)
        if got is None:
            return None
        metadata, tensors = got
        if not isinstance(metadata, dict) or STATE_KEY not in metadata:
            raise StateMismatch("the replica sent no stage state")
        try:
            return restore_like(metadata[STATE_KEY], tensors, like)
        except StateMismatch:
            for other in likes:
                with contextlib.suppress(StateMismatch):
                    return restore_like(metadata[STATE_KEY], tensors, other)
            raise

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None,
                                     sources: Sequence[str] = ()) -> None:
        """hivemind's download (in the averager process), asking members in random order: hivemind
        1.1.12 asks the peer that declared the highest priority first, which any member may declare,
        and offers no way to ask only some (a re-sync must load the stage's digest)."""
        chunk_timeout = self.next_chunk_timeout or self.request_timeout
        try:
            peers = [p for p in await self.members(fresh=True) if p != self.peer_id]
            if sources:
                peers = [p for p in peers if p.to_base58() in sources]
            random.shuffle(peers)
            peers.sort(key=lambda p: p in self._dial_out)  # one dialing out answers over its own connection only
            for peer in peers:
                try:
                    stream = await self.get_stub(self._p2p, peer, namespace=self.prefix).rpc_download_state(
                        averaging_pb2.DownloadRequest())
                    metadata, tensors, parts = None, [], []
                    async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
                        if message.metadata:
                            metadata = self.serializer.loads(message.metadata)
                        if message.tensor_part.dtype and parts:  # a new tensor begins
                            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                            parts = []
                        parts.append(message.tensor_part)
                    if parts:
                        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    if metadata:
                        future.set_result((metadata, tensors))
                        return
                    logger.debug("stage %d: %s sent no state", self.stage, peer)
                except Exception as e:
                    logger.warning("stage %d: downloading the state from %s failed: %r", self.stage, peer, e)
        finally:
            if not future.done():
                future.set_result(None)
