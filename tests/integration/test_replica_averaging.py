"""Members-only averaging among a stage's replicas, on real hivemind DHT nodes and averagers.

Two replicas certified for stage 1 average their tensors (weighted by samples, hivemind's
all-reduce) and one downloads the other's stage state (checked against its own before use). A
member certified for stage 2 and an outsider without a certificate both address the replicas'
real averager RPCs directly — join the group, send a part, download the state, ask for a step's
inputs — and run an averager of their own under stage 1's prefix: every request is refused and
counted, their DHT records under stage 1's averaging keys are dropped by every certified node,
and the replicas' average is exactly the two replicas'. One set of nodes for every check (DHT and
averager starts are slow), all started from the main thread.
"""

from __future__ import annotations

import asyncio
import functools
import signal
from typing import Any

import pytest
import torch

from mapl_swarm.net.discovery import Discovery, TrustedAuthority, averaging_prefix, member_keys
from mapl_swarm.net.identity import (
    create_peer_key,
    issue,
    issue_local,
    libp2p_peer_id,
    load_identity,
    make_request,
    write_signed,
)

from test_dht_certified import config, stored_subkeys, with_bootstrap

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

RUN = "run.replicas"  # a run id with a '.', which hivemind's prefixes may not hold


async def attack(target: bytes, prefix: str, _dht: Any, node: Any) -> dict[str, Any]:
    """Runs inside the attacker's DHT process: every averager RPC of ``target`` addressed directly."""
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import as_aiter
    from hivemind.utils.timed_storage import get_dht_time

    from mapl_swarm.replicas.averaging import StageAverager

    stub = StageAverager.get_stub(node.protocol.p2p, PeerID(target), namespace=prefix)

    async def answers(call: Any, request: Any, code: bool = True) -> list[Any]:
        """What came back; the refusing side may close the stream before its answer is read."""
        try:
            return [m.code if code else m async for m in await call(request)]
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            return ["closed"]

    return {"join": await answers(stub.rpc_join_group, averaging_pb2.JoinRequest(
                schema_hash=b"x", expiration=get_dht_time() + 10)),
            "part": await answers(stub.rpc_aggregate_part, as_aiter(averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g"))),
            "state": await answers(stub.rpc_download_state, averaging_pb2.DownloadRequest(), code=False),
            "kept": await answers(stub.rpc_kept_round, averaging_pb2.AveragingData(group_id=b"g")),
            "inputs": await answers(stub.rpc_work_inputs, averaging_pb2.AveragingData(group_id=b"\x92\x00\x00"),
                                    code=False),
            "share": await answers(stub.rpc_sparse_share, averaging_pb2.AveragingData(group_id=b"g.S"))}


def breakable() -> type:
    """A stage averager whose all-reduce breaks on demand (``breaks`` set) once it ran, as a stream
    from a partner's reducer that ends a part early leaves it: its values not the average, the round
    failed here while the partner may have kept it (``broke`` counts those)."""
    import multiprocessing as mp

    from hivemind.averaging.partition import AllreduceException

    from mapl_swarm.replicas.averaging import StageAverager

    class Breakable(StageAverager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.breaks, self.broke = mp.Value("i", 0), mp.Value("i", 0)
            super().__init__(*args, **kwargs)

        def _check_whole(self, runner: Any, tensors: Any) -> None:
            super()._check_whole(runner, tensors)
            if self.breaks.value:
                for tensor in tensors:
                    tensor.zero_()
                with self.broke.get_lock():
                    self.broke.value += 1
                raise AllreduceException("peer sent 6 parts, but we expected 7 (broken on purpose)")

    Breakable.__name__ = StageAverager.__name__  # hivemind names RPC handlers after the class: the same ones
    return Breakable


def scenario(bootstrap_dht: Any, maddrs: list[str], ids: list) -> None:
    from hivemind.averaging.allreduce import AveragingMode
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.averaging.matchmaking import MatchmakingException
    from hivemind.proto import averaging_pb2
    from hivemind.utils.timed_storage import get_dht_time

    from mapl_swarm.replicas.averaging import NobodyKept, StageAverager

    Breakable = breakable()

    replica_a, replica_b, member = ids
    averagers: dict[str, Any] = {}
    try:  # the DHT nodes close first (leaving the with), then the averagers: an averager gone first leaves
        # its requests in its DHT node's pipe, which then takes its whole shutdown timeout (15 s) to stop
        with Discovery(RUN, config(maddrs), membership=replica_a) as a, \
                Discovery(RUN, config(maddrs), membership=replica_b) as b, \
                Discovery(RUN, config(maddrs), membership=member) as m, \
                Discovery(RUN, config(maddrs)) as outsider:
            # a certified peer's DHT peer id derives from its certificate's signing key
            assert a.dht.peer_id.to_bytes() == libp2p_peer_id(replica_a.body.sign_key)
            tensors = {name: [torch.full((64,), value)] for name, value in
                       (("a", 1.0), ("b", 3.0), ("m", 100.0), ("o", -100.0))}
            weights = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)  # replica a's stage state
            states = {"a": lambda: {"modules": {"w": weights}, "step": 5, "data": {"cursor": 40}}}
            # a handler of our own: a test run as a background job starts with SIGINT ignored
            sigint = signal.default_int_handler
            previous = signal.signal(signal.SIGINT, sigint)
            try:
                for name, disc in (("a", a), ("b", b), ("m", m), ("o", outsider)):
                    kind = Breakable if name in ("a", "b") else StageAverager
                    averagers[name] = kind(tensors[name], disc.dht, run_id=RUN, stage=1, replicas=2,
                                           state=states.get(name), start=True)
                kept = signal.getsignal(signal.SIGINT)
            finally:
                signal.signal(signal.SIGINT, previous)
            assert kept is sigint  # hivemind sets SIGINT to SIG_IGN in the process that starts an averager
            avg_a, avg_b = averagers["a"], averagers["b"]
            prefix = averaging_prefix(RUN, 1)
            for attacker in ("m", "o"):
                got = averagers[attacker].dht.run_coroutine(
                    functools.partial(attack, avg_a.peer_id.to_bytes(), prefix))
                refused = ([averaging_pb2.PROTOCOL_VIOLATION], [], ["closed"])  # never a group, a part or a state
                assert got["join"] in refused and got["part"] in refused and got["state"] in ([], ["closed"]) \
                    and got["kept"] in refused and got["inputs"] in ([], ["closed"]) and got["share"] in refused, \
                    (attacker, got)
            assert avg_a.refused == {"join_group": 2, "aggregate_part": 2, "download_state": 2, "kept_round": 2,
                                     "work_inputs": 2, "sparse_share": 2, "group": 0}

            # a group a member's leader assembled with a stranger is refused before any tensor is sent
            stranger = averagers["o"].peer_id
            with pytest.raises(MatchmakingException, match="no replicas of stage 1"):
                asyncio.run(avg_a._aggregate_with_group(GroupInfo(b"g", (avg_a.peer_id, stranger), (b"", b"")), 0))
            assert avg_a.refused["group"] == 1
            # a member declaring a bandwidth of its own would reduce nearly all of the update: refused
            pack = avg_a.serializer.dumps
            fair, greedy = (pack([bw, AveragingMode.NODE.value, pack({"step": 1})]) for bw in (None, 1e9))
            # and one that reduces no part (hivemind's client mode) must have declared itself dial-out
            shirker = pack([None, AveragingMode.CLIENT.value, pack({"step": 1})])
            for theirs in (greedy, shirker):
                with pytest.raises(MatchmakingException, match="declared a bandwidth or mode of their own"):
                    asyncio.run(avg_a._aggregate_with_group(GroupInfo(b"g", (avg_a.peer_id, avg_b.peer_id),
                                                                      (fair, theirs)), 0))

            # the intruders' averagers also look for a group, while the replicas average
            intruders = [averagers[x].step(weight=1.0, timeout=8, wait=False, allow_retries=False)
                         for x in ("m", "o")]
            steps = [avg_a.step(weight=1.0, timeout=30, wait=False), avg_b.step(weight=3.0, timeout=30, wait=False)]
            groups = [s.result(timeout=40) for s in steps]
            assert all(g is not None and set(g) == {avg_a.peer_id, avg_b.peer_id} for g in groups), groups
            with avg_a.get_tensors() as ta, avg_b.get_tensors() as tb:
                assert torch.equal(ta[0], tb[0])  # every replica holds the same bytes
                assert torch.allclose(ta[0], torch.full((64,), 2.5))  # (1 * 1 + 3 * 3) / 4
            for s in intruders:
                with pytest.raises(Exception):
                    s.result(timeout=20)

            # b's all-reduce breaks after a kept the round: b takes a's result, and the round counts at both
            for avg, value in ((avg_a, 2.0), (avg_b, 6.0)):
                with avg.filling() as t:
                    t[0].fill_(value)
            avg_b.breaks.value = 1
            steps = [avg_a.step(weight=1.0, timeout=30, wait=False, allow_retries=False),
                     avg_b.step(weight=3.0, timeout=30, wait=False, allow_retries=False)]
            groups = [s.result(timeout=80) for s in steps]
            assert all(g is not None and set(g) == {avg_a.peer_id, avg_b.peer_id} for g in groups), groups
            assert avg_b.broke.value == 1
            with avg_a.get_tensors() as ta, avg_b.get_tensors() as tb:
                assert torch.equal(ta[0], tb[0]) and torch.allclose(ta[0], torch.full((64,), 5.0))  # (2 + 18) / 4
            # both break: each learns from the other that neither kept the round, so it fails at both
            # as one that nobody applied (run again, no step redone)
            avg_a.breaks.value = 1
            steps = [avg_a.step(weight=1.0, timeout=30, wait=False, allow_retries=False),
                     avg_b.step(weight=3.0, timeout=30, wait=False, allow_retries=False)]
            for s in steps:
                with pytest.raises(NobodyKept, match="broke at every member"):
                    s.result(timeout=80)
            assert (avg_a.broke.value, avg_b.broke.value) == (1, 2)
            avg_a.breaks.value = avg_b.breaks.value = 0

            # a replica downloads another's stage state; certified nodes hold no intruder under stage 1's keys
            like = {"modules": {"w": torch.zeros(3, 4, dtype=torch.bfloat16)}, "step": 0, "data": {"cursor": 0}}
            stepped = {**like, "optimizer": {"exp_avg": torch.zeros(3)}}  # a form the served state does not have
            got = avg_b.download_state(stepped, like, timeout=20)  # the first form it fits
            assert torch.equal(got["modules"]["w"], weights) and (got["step"], got["data"]) == (5, {"cursor": 40})
            held = bootstrap_dht.run_coroutine(functools.partial(stored_subkeys, member_keys(RUN, 1)[1]))
            assert len(held) == 2, held  # the replicas' two records, no intruder's
            members = a.dht.get(member_keys(RUN, 1)[1], latest=True).value
            assert set(members) == {avg_a.peer_id.to_bytes(), avg_b.peer_id.to_bytes()}
            # a member's record outlives its renewal period: a late renewal leaves no gap
            assert all(v.expiration_time - get_dht_time() > avg_a.declare_state_period for v in members.values())
    finally:
        for averager in averagers.values():
            averager.shutdown()


@pytest.mark.timeout(180)
def test_only_certified_replicas_of_a_stage_average_and_share_state(tmp_path, monkeypatch) -> None:
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=3)
    second = create_peer_key(tmp_path / "ids" / "stage1b.key")
    write_signed(tmp_path / "ids" / "stage1b.cert",
                 issue(local.authority, make_request(second, "stage1b", [1]), run_id=RUN, valid_s=3600))
    ids = [load_identity(local.key_file(1), local.cert_file(1), run_id=RUN, stage=1),
           load_identity(tmp_path / "ids" / "stage1b.key", tmp_path / "ids" / "stage1b.cert", run_id=RUN, stage=1),
           load_identity(local.key_file(2), local.cert_file(2), run_id=RUN, stage=2)]
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public), functools.partial(scenario, ids=ids))


def robust_scenario(_bootstrap: Any, maddrs: list[str], ids: list) -> None:
    """Three replicas of stage 1 average with CenteredClip; one sends its share scaled by -10."""
    from mapl_swarm.replicas.averaging import StageAverager
    from mapl_swarm.replicas.robust import centered_clip

    gen = torch.Generator().manual_seed(0)
    common = torch.randn(4096, generator=gen)
    shares = [common + 0.1 * torch.randn(4096, generator=gen) for _ in range(2)]
    shares.append(-10 * shares[0])
    averagers: list[Any] = []
    try:
        with Discovery(RUN, config(maddrs), membership=ids[0]) as a, \
                Discovery(RUN, config(maddrs), membership=ids[1]) as b, \
                Discovery(RUN, config(maddrs), membership=ids[2]) as c:
            for disc, share in zip((a, b, c), shares):
                averagers.append(StageAverager([share.clone()], disc.dht, run_id=RUN, stage=1, replicas=3,
                                               aggregation="centered_clip", start=True))
            steps = [avg.step(weight=1.0, timeout=40, wait=False, allow_retries=False) for avg in averagers]
            groups = [s.result(timeout=80) for s in steps]
            assert all(g is not None and len(g) == 3 for g in groups), groups
            results = []
            for avg in averagers:
                with avg.get_tensors() as t:
                    results.append(t[0].clone())
            assert all(torch.equal(r, results[0]) for r in results)  # every replica holds the same bytes
            honest = (shares[0] + shares[1]) / 2
            mean = sum(shares) / 3
            # the reducers clip per part, so not exactly centered_clip of the whole vector: close to it,
            # and far nearer the honest mean than the mean is
            assert float((results[0] - honest).norm()) < 0.2 * float((mean - honest).norm())
            whole = centered_clip(shares, [1.0, 1.0, 1.0])
            assert float((results[0] - whole).norm()) < float((mean - honest).norm())
    finally:
        for averager in averagers:
            averager.shutdown()


@pytest.mark.timeout(180)
def test_with_centered_clip_a_replicas_share_scaled_by_minus_ten_barely_moves_the_stages_update(
        tmp_path, monkeypatch) -> None:
    """Issue 46 item 2: three certified replicas of a stage on real averagers, one sending its
    gradient share scaled by -10: with ``replicas.aggregation = "centered_clip"`` the three end with
    the same bytes, within a fifth of the distance the plain mean would be from the honest mean."""
    local = issue_local(tmp_path / "ids", run_id=RUN, num_stages=3, replicas=[1, 3, 1])
    ids = [load_identity(local.key_file(1, r), local.cert_file(1, r), run_id=RUN, stage=1) for r in range(3)]
    with_bootstrap(monkeypatch, TrustedAuthority(RUN, local.authority.public),
                   functools.partial(robust_scenario, ids=ids))
