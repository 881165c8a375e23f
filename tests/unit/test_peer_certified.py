"""Certified peers (SPEC §7.1) on the in-memory network: each stage has its own identity, and a
HELLO is welcomed only with a certificate of the run's authority for the sender's stage and the
CURVE key its connection proved.

Every forged HELLO below comes from a connection with its own key, as a member holding some other
certificate (or none) would send it, while the real stages train; each is refused on its own
connection as ``not_certified`` with the certificate's fault named, and the losses stay those of
an uncertified run to the last bit.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from mapl_swarm.net.identity import (PeerKey, create_authority, issue, issue_local, load_identity, make_request)
from mapl_swarm.wire import Message, MessageType, decode, encode

from peer_fakes import fake_swarm, on_first, run_swarm, serve_all, swarm_config

MT = MessageType
HELLO = {"fingerprint": "fp", "num_stages": 2, "capabilities": ["1f1b"], "peer": "stage0", "nonce": b"n" * 16,
         "num_micro_batches": 2, "micro_batch_size": 2, "eval_batches": 1}


def _identities(folder, run_id="mem", stages=2):
    local = issue_local(folder, run_id=run_id, num_stages=stages)
    return local, [load_identity(local.key_file(s), local.cert_file(s), run_id=run_id, stage=s) for s in range(stages)]


def _run(identities, setup=None):
    async def main():
        net, peers, transports = fake_swarm(swarm_config(), identities=identities)
        if setup is not None:
            setup(net)
        return net, await run_swarm(peers, transports)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def uncertified():
    return _run(None)[1]


def test_certified_stages_train_like_uncertified_ones_and_carry_their_certificates(tmp_path, uncertified):
    _, ids = _identities(tmp_path)
    headers = []

    def setup(net):
        net.tap = lambda sender, dst, frames, reply: headers.append(msgpack.unpackb(frames[0]))

    net, results = _run(ids, setup)
    assert results[0].train_losses == uncertified[0].train_losses
    assert all(r.rejects == {} for r in results)
    hellos = [m for _, _, m, _ in net.log if m is not None and m.type is MT.HELLO]
    assert {m.src for m in hellos} == {0, 1}
    assert all(m.meta["cert"] == ids[m.src].encoded_cert for m in hellos)
    assert headers and not any("auth" in h for h in headers)  # no wire tag: CURVE covers what it covered


def test_a_hello_without_the_right_certificate_is_refused_and_training_is_unchanged(tmp_path, uncertified):
    local, ids = _identities(tmp_path / "run")
    _, others = _identities(tmp_path / "other")  # another authority's swarm, same run id
    intruder = PeerKey(bytes(range(32)))
    stage0_for_intruder = issue(local.authority, make_request(intruder, "intruder", [0]), run_id="mem").encode()
    broken = stage0_for_intruder[:-1] + bytes([stage0_for_intruder[-1] ^ 1])  # the signature's last byte
    forged = {  # routing id -> (the key its connection proves, the certificate its HELLO carries)
        "stage0.00000001": (intruder.curve_public, None),
        "stage0.00000002": (ids[1].key.curve_public, ids[1].encoded_cert),  # stage 1's own: not for stage 0
        "stage0.00000003": (intruder.curve_public, ids[0].encoded_cert),  # stage 0's, on another key
        "stage0.00000004": (others[0].key.curve_public, others[0].encoded_cert),  # another authority's
        "stage0.00000005": (intruder.curve_public, broken),  # a broken signature
        "stage0.00000006": (intruder.curve_public, b"\x93garbage"),
    }

    def setup(net):
        def attack(_):
            for rid, (key, cert) in forged.items():
                meta = {**HELLO, **({"cert": cert} if cert is not None else {})}
                net.inject("stage1", rid, encode(Message(type=MT.HELLO, run_id="mem", src=0, dst=1, meta=meta)),
                           key=key)
        on_first(net, "stage0", MT.ACT, attack)

    net, results = _run(ids, setup)
    assert results[0].train_losses == uncertified[0].train_losses
    assert results[1].rejects == {"not_certified": 6}
    reasons = {rid: decode(net.orphan_replies[rid][0]).meta for rid in forged}
    assert all(r["code"] == "not_certified" for r in reasons.values())
    faults = {rid: r["reason"].rsplit("(", 1)[1].rstrip(")") for rid, r in reasons.items()}
    assert faults == {"stage0.00000001": "malformed", "stage0.00000002": "stage_not_allowed",
                      "stage0.00000003": "wrong_key", "stage0.00000004": "wrong_authority",
                      "stage0.00000005": "bad_signature", "stage0.00000006": "malformed"}
    assert not any(m.type == MT.REJECT for m in net.messages("stage1", "stage0"))  # the real stage 0 heard none


def test_a_certificate_of_the_right_stage_and_key_is_welcomed(tmp_path):
    """The check accepts what it should: a second holder of a stage-0 certificate (say, a
    replacement host) is refused only because the stage is taken, not for its certificate."""
    local, ids = _identities(tmp_path)
    spare = PeerKey(bytes(range(1, 33)))
    cert = issue(local.authority, make_request(spare, "spare", [0]), run_id="mem").encode()
    hello = encode(Message(type=MT.HELLO, run_id="mem", src=0, dst=1, meta={**HELLO, "cert": cert}))

    def setup(net):
        on_first(net, "stage0", MT.ACT, lambda _: net.inject("stage1", "stage0.0000beef", hello, key=spare.curve_public))

    net, results = _run(ids, setup)
    assert results[1].rejects == {"stage_taken": 1}
    assert decode(net.orphan_replies["stage0.0000beef"][0]).meta["code"] == "stage_taken"


def test_a_spare_first_to_hello_is_refused_while_this_peer_dials_another_identity(tmp_path, uncertified):
    """Both directions of a link are one identity (SPEC §7.2 item 7): a spare certified for stage 0
    whose HELLO reaches stage 1 before the real stage 0's is refused (``stage_taken``), since stage 1
    dials the real one; found by attacking a live swarm, where the spare bound stage 0's inbound
    session while the real stage 1 held its outbound one."""
    local, ids = _identities(tmp_path)
    spare = PeerKey(bytes(range(1, 33)))
    cert = issue(local.authority, make_request(spare, "spare", [0]), run_id="mem").encode()
    hello = encode(Message(type=MT.HELLO, run_id="mem", src=0, dst=1, meta={**HELLO, "cert": cert}))

    def setup(net):
        on_first(net, "stage0", MT.HELLO, lambda _: net.inject("stage1", "stage0.0000beef", hello,
                                                             key=spare.curve_public))

    net, results = _run(ids, setup)
    assert results[0].train_losses == uncertified[0].train_losses and results[1].rejects == {"stage_taken": 1}
    refusal = decode(net.orphan_replies["stage0.0000beef"][0]).meta
    assert refusal["code"] == "stage_taken" and "'spare', another identity than the one this peer dials" in \
        refusal["reason"]


def test_a_certificate_that_does_not_fit_is_refused_when_the_peer_loads_it(tmp_path):
    from mapl_swarm.errors import ConfigError
    from mapl_swarm.net.identity import create_peer_key, write_signed

    authority = create_authority(tmp_path / "authority.key")
    key = create_peer_key(tmp_path / "p.key")
    write_signed(tmp_path / "p.cert", issue(authority, make_request(key, "p", [1]), run_id="mem", valid_s=10, now=1000))
    with pytest.raises(ConfigError, match=r"p\.cert: .*expired"):
        load_identity(tmp_path / "p.key", tmp_path / "p.cert", run_id="mem", stage=1)
    write_signed(tmp_path / "q.cert", issue(authority, make_request(key, "p", [1]), run_id="mem"))
    with pytest.raises(ConfigError, match=r"q\.cert: .*not 0 \(stage_not_allowed\)"):
        load_identity(tmp_path / "p.key", tmp_path / "q.cert", run_id="mem", stage=0)
    with pytest.raises(ConfigError, match=r"q\.cert: .*not 'other' \(wrong_run\)"):
        load_identity(tmp_path / "p.key", tmp_path / "q.cert", run_id="other", stage=1)
    create_peer_key(tmp_path / "o.key")
    with pytest.raises(ConfigError, match=r"q\.cert is for another peer key than .*o\.key"):
        load_identity(tmp_path / "o.key", tmp_path / "q.cert", run_id="mem", stage=1)
    assert load_identity(tmp_path / "p.key", tmp_path / "q.cert", run_id="mem", stage=1).body.stages == (1,)


def test_local_identities_are_kept_while_they_fit_and_reissued_when_not(tmp_path):
    first = issue_local(tmp_path, run_id="r", num_stages=2)
    certs = [first.cert_file(s).read_bytes() for s in range(2)]
    again = issue_local(tmp_path, run_id="r", num_stages=2)  # a resumed run keeps its identities
    assert [again.cert_file(s).read_bytes() for s in range(2)] == certs
    assert again.authority.public == first.authority.public
    other = issue_local(tmp_path, run_id="r2", num_stages=3)  # another run id: new certificates, same keys
    assert other.cert_file(0).read_bytes() != certs[0]
    assert load_identity(other.key_file(2), other.cert_file(2), run_id="r2", stage=2).body.roles == ("drain",)
    assert other.args(1) == ["--peer-key", str(tmp_path / "stage1.key"), "--cert", str(tmp_path / "stage1.cert")]


def _drain_asked_by_stage1(identities):
    """Stage 1 asks stage 0 to drain the swarm (as its SIGINT would) once stage 0's first ACT is out."""
    async def main():
        net, peers, transports = fake_swarm(swarm_config(run={"steps": 6, "run_id": "mem"}), identities=identities)

        on_first(net, "stage0", MT.ACT,
                 lambda _: asyncio.get_running_loop().create_task(peers[1].agreement.request("SIGINT at stage 1")))
        return await run_swarm(peers, transports)

    return asyncio.run(main())


def test_a_drain_request_is_obeyed_only_from_a_certificate_with_the_drain_role(tmp_path):
    local = issue_local(tmp_path / "no-role", run_id="mem", num_stages=2, roles=())
    plain = [load_identity(local.key_file(s), local.cert_file(s), run_id="mem", stage=s) for s in range(2)]
    refused = _drain_asked_by_stage1(plain)
    assert refused[0].rejects == {"not_allowed": 1} and len(refused[0].train_losses) == 6
    assert refused[0].end == "finished"
    _, allowed = _identities(tmp_path / "drain")  # a local swarm's certificates allow drain
    drained = _drain_asked_by_stage1(allowed)
    assert drained[0].rejects == {} and drained[0].end != "finished" and len(drained[0].train_losses) < 6


def test_only_the_bound_neighbours_own_identity_can_re_form_a_training_swarm(tmp_path):
    """A HELLO of a higher run epoch while training: from the bound stage-0 peer on a new
    connection it re-forms; from another holder of a stage-0 certificate it is ``stage_taken``."""
    import dataclasses

    from mapl_swarm.peer.runtime import PeerState
    from mapl_swarm.peer.session import HelloRefused
    from mapl_swarm.wire import decode_header
    from mapl_swarm.wire.spec import REJOIN_CAPABILITY

    local, ids = _identities(tmp_path)
    spare = PeerKey(bytes(range(2, 34)))
    spare_cert = issue(local.authority, make_request(spare, "spare", [0]), run_id="mem").encode()

    async def main():
        net, peers, _ = fake_swarm(swarm_config(), identities=ids)
        stage1 = peers[1]
        admission = stage1.admission
        admission.s = dataclasses.replace(admission.s, capabilities=(*admission.s.capabilities, REJOIN_CAPABILITY))
        link = stage1.links.route(0)
        meta = {**HELLO, "capabilities": ["1f1b", REJOIN_CAPABILITY]}

        async def welcome_sent(frames, kind) -> None:
            return None

        def hello(cert: bytes, epoch: int):
            frames = encode(Message(type=MT.HELLO, run_id="mem", src=0, dst=1, epoch=epoch, meta={**meta, "cert": cert}))
            return decode_header(frames)[0]

        admission.check_hello(hello(ids[0].encoded_cert, 0), link, "stage0.00000001", ids[0].key.curve_public)
        await link.on_hello(decode(encode(Message(type=MT.HELLO, run_id="mem", src=0, dst=1,
                                                  meta={**meta, "cert": ids[0].encoded_cert}))),
                            "stage0.00000001", welcome_sent, now=admission.clock())
        stage1.state, stage1.ingress.started = PeerState.TRAINING, True  # as once training started
        with pytest.raises(HelloRefused) as refused:
            admission.check_hello(hello(spare_cert, 5), link, "stage0.00000002", spare.curve_public)
        assert refused.value.code == "stage_taken"
        admission.check_hello(hello(ids[0].encoded_cert, 5), link, "stage0.00000003", ids[0].key.curve_public)

    asyncio.run(main())


def test_a_welcome_must_carry_the_certificate_of_the_pinned_server(tmp_path, uncertified):
    """Stage 1's first WELCOME arrives with stage 0's certificate in it (a server answering with
    another's): stage 0 drops it as ``not_certified``, says HELLO again and trains as ever."""
    _, ids = _identities(tmp_path)

    def another_certificate(frames):
        msg = decode(frames)
        msg.meta["cert"] = ids[0].encoded_cert
        frames[:] = encode(msg)

    def setup(net):
        on_first(net, "stage1", MT.WELCOME, another_certificate, reply=True)

    net, results = _run(ids, setup)
    assert results[0].rejects == {"not_certified": 1}
    assert results[0].train_losses == uncertified[0].train_losses


def test_a_newer_revocation_list_cuts_a_neighbour_off_while_training(tmp_path):
    """Stage 1 runs with a revocation list file; the operator revokes stage 0's certificate while
    the swarm trains: stage 1 reads the new list within seconds and treats stage 0 as departed
    (without rejoin, that ends it, naming why), long before the run's 400 steps."""
    from mapl_swarm.net.identity import revoke, write_signed

    local, ids = _identities(tmp_path)
    lists = tmp_path / "revoked.list"
    write_signed(lists, revoke(local.authority, [], run_id="mem", now=1000))
    ids[1] = load_identity(local.key_file(1), local.cert_file(1), run_id="mem", stage=1, revocations=lists)
    assert ids[1].watch is not None and ids[1].revoked == set()

    async def main():
        net, peers, transports = fake_swarm(swarm_config(run={"steps": 400, "run_id": "mem"}), identities=ids)

        revoked = revoke(local.authority, [ids[0].body.serial], run_id="mem", now=2000)
        on_first(net, "stage0", MT.ACT, lambda _: write_signed(lists, revoked, force=True))
        return await serve_all(peers, transports, timeout_s=60)

    results = asyncio.run(main())
    from mapl_swarm.peer.departures import NeighbourLost

    assert ids[1].revoked == {ids[0].body.serial}
    assert isinstance(results[1], NeighbourLost) and "stage 0 at mem://stage0 left before the end: its " \
        f"certificate (serial {ids[0].body.serial}) is revoked" in str(results[1])


def test_a_stage_without_the_drain_role_leaves_on_its_signal_instead_of_draining_the_swarm(tmp_path):
    from mapl_swarm.peer.signals import Interrupted

    local = issue_local(tmp_path, run_id="mem", num_stages=2, roles=())
    ids = [load_identity(local.key_file(s), local.cert_file(s), run_id="mem", stage=s) for s in range(2)]

    async def main():
        net, peers, transports = fake_swarm(swarm_config(run={"steps": 400, "run_id": "mem"}), identities=ids)

        on_first(net, "stage1", MT.GRAD, lambda _: peers[1].request_drain("SIGINT"))
        return net, await serve_all(peers, transports, timeout_s=60)

    net, results = asyncio.run(main())
    assert isinstance(results[1], Interrupted) and "its certificate does not allow it to drain the whole swarm " \
        "(role drain)" in str(results[1])
    assert not any(m.type is MT.CHECKPOINT for m in net.messages("stage1", "stage0"))  # no drain request


def test_a_revoked_replica_departs_alone_while_its_stage_keeps_a_live_replica():
    """Revoking one of stage 0's two replicas cuts off that replica only: stage 1 goes on with the
    other (its contact is gone, nothing pauses); revoking the last one too is a departure of the
    stage, which ends this peer as any lost neighbour does (no rejoin configured here). Before, the
    revoked link's sessions ended first and the schedule took it for its stage's last replica."""
    from mapl_swarm.peer.departures import NeighbourLost
    from mapl_swarm.peer.runtime import Peer, PeerState
    from mapl_swarm.pipeline.stage import StageRuntime

    async def main():
        cfg = swarm_config(pipeline={"num_stages": 3}, replicas={"enabled": True, "initial": [2, 1, 1]})

        async def resolve(stage, timeout_s):
            return f"mem://stage{stage}"

        async def announce(endpoint):
            return None

        peer = Peer(cfg, 1, StageRuntime(cfg, 1), fingerprint="fp", resolve=resolve, announce=announce)
        first, second, down = (peer.linker.new_link(s, c) for s, c in ((0, "mem://a0"), (0, "mem://b0"), (2, "mem://c2")))
        for link in (first, second, down):
            link.welcomed = True
        peer.schedule.begin(0, 0)
        peer.state = PeerState.TRAINING
        peer.cut_off(first, "its certificate (serial 7) is revoked")
        assert peer.stop_reason is None and peer.schedule.gone == {"mem://a0"} and not first.welcomed
        peer.cut_off(second, "its certificate (serial 8) is revoked")
        assert isinstance(peer.stop_reason, NeighbourLost) and "serial 8" in str(peer.stop_reason)
        peer.decoder.close()
        peer.compute.close()

    asyncio.run(main())


def test_a_drain_decision_counts_only_signed_by_stage_0_and_passes_through_any_stage(tmp_path):
    """A certified 3-stage swarm (SPEC §5.2): stage 0 signs its drain decision, which stage 1 (whose
    certificate has no drain role) passes on unchanged, so stage 2 drains at the same step. A
    member of stage 1 running modified code that tells stage 2 the swarm drains, unsigned or
    signed with its own certificate, is refused (``not_allowed``) and the run trains on to its end
    (a CHECKPOINT ``drain`` from any neighbour used to be obeyed)."""
    local = issue_local(tmp_path, run_id="mem", num_stages=3, roles=())
    ids = [load_identity(local.key_file(s), local.cert_file(s), run_id="mem", stage=s) for s in range(3)]
    cfg = swarm_config(pipeline={"num_stages": 3}, run={"steps": 6, "run_id": "mem"})

    def run(setup):
        async def main():
            net, peers, transports = fake_swarm(cfg, identities=ids)
            setup(net, peers)
            return await run_swarm(peers, transports)
        return asyncio.run(main())

    def forged(net, peers):
        async def lie():
            await peers[1].agreement.send(2, {"phase": "drain", "step": 2})
            await peers[1].agreement.send(2, {"phase": "drain", "step": 3, **ids[1].sign_drain(0, 3)})
        on_first(net, "stage1", MT.ACT, lambda _: asyncio.get_running_loop().create_task(lie()))

    results = run(forged)
    assert results[2].rejects == {"not_allowed": 2}, results[2].rejects
    assert all(r.end == "finished" for r in results) and len(results[0].train_losses) == 6

    def asked(net, peers):  # stage 0 itself is asked (as its SIGINT would): its decision travels signed
        on_first(net, "stage0", MT.ACT,
                 lambda _: asyncio.get_running_loop().create_task(peers[0].agreement.request("SIGINT at stage 0")))

    drained = run(asked)
    assert all(r.rejects == {} for r in drained), [r.rejects for r in drained]
    assert [r.end for r in drained] == ["drained"] * 3 and len({r.drained_at for r in drained}) == 1
