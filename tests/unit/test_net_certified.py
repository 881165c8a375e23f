"""Links to named peers and certified DHT records (SPEC §7.1), without a DHT or a swarm.

Transport: real sockets on 127.0.0.1 (port 0); a dialer pins the server key of a contact, so a party
listening with another key (a relay, an impostor) completes no handshake; every message is
attributed to the key its connection proved. Records: :class:`CertifiedRecordValidator` accepts a
record only from a peer certified for its stage, at a contact of its own key, for a short time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import warnings
from typing import AsyncIterator

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio
from zmq.utils import z85

with warnings.catch_warnings():  # hivemind imports torch, whose jit module warns; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

from mapl_swarm.net.dht_validation import CERTIFIED_MAX_TTL_S, CertifiedRecordValidator
from mapl_swarm.net.discovery import TrustedAuthority, dht_validators, member_keys, stage_key
from mapl_swarm.net.errors import NetError, NetTimeoutError
from mapl_swarm.net.identity import (PeerIdentity, PeerKey, issue, issue_local, libp2p_peer_id, load_identity,
                                     make_request, revoke, verify_revocations)
from mapl_swarm.net.transport import Transport, TransportConfig, contact, split_contact

RUN = "cert-run"
SILENCE_S = 0.5


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A local authority and the identities of stages 0..2."""
    local = issue_local(tmp_path_factory.mktemp("ids"), run_id=RUN, num_stages=3)
    return local, [load_identity(local.key_file(s), local.cert_file(s), run_id=RUN, stage=s) for s in range(3)]


def pinned(identity: PeerIdentity) -> TransportConfig:
    return TransportConfig(bind_host="127.0.0.1", curve=identity.curve, send_timeout_s=5)


@pytest_asyncio.fixture
async def pair(swarm) -> AsyncIterator[tuple[Transport, Transport]]:
    _, ids = swarm
    async with Transport("stage0", pinned(ids[0])) as a, Transport("stage1", pinned(ids[1])) as b:
        yield a, b


# ---------------------------------------------------------------------- contacts and the transport
def test_a_contact_is_an_endpoint_and_a_key():
    key = bytes(range(32))
    text = contact("tcp://10.0.0.5:41234", key)
    assert text == "tcp://10.0.0.5:41234#" + key.hex()
    assert split_contact(text) == ("tcp://10.0.0.5:41234", key)
    assert split_contact("tcp://[::1]:5") == ("tcp://[::1]:5", None)
    for bad in ("tcp://h:1#00", "tcp://h:1#" + key.hex().upper(), "tcp://h:1#" + "zz" * 32):
        with pytest.raises(NetError, match="64 lowercase hex digits"):
            split_contact(bad)


@pytest.mark.asyncio
async def test_a_pinned_link_delivers_and_attributes_each_message_to_its_key(pair, swarm):
    a, b = pair
    _, ids = swarm
    assert split_contact(b.endpoint)[1] == ids[1].key.curve_public
    a.connect("stage1", b.endpoint)
    await a.send("stage1", [b"hello"])
    sender, frames = await b.recv(timeout_s=5)
    assert frames == [b"hello"] and sender == a.routing_id
    assert b.peer_key(sender) == ids[0].key.curve_public and b.peer_key("stage9.00000000") is None


@pytest.mark.asyncio
async def test_a_dialer_completes_no_handshake_with_a_listener_of_another_key(pair, swarm):
    """A relay or an impostor at the contact's address, holding its own keypair (here stage 2's)."""
    a, b = pair
    _, ids = swarm
    impostor = Transport("stage1", pinned(ids[2]))
    impostor.start()
    try:
        a.connect("stage1", contact(split_contact(impostor.endpoint)[0], ids[1].key.curve_public))
        await a.send("stage1", [b"secret"])
        with pytest.raises(NetTimeoutError):
            await impostor.recv(timeout_s=SILENCE_S)
    finally:
        await impostor.aclose()


@pytest.mark.asyncio
async def test_a_pinned_transport_dials_contacts_only(pair):
    a, b = pair
    with pytest.raises(NetError, match="dials contacts only"):
        a.connect("stage1", split_contact(b.endpoint)[0])


@pytest.mark.asyncio
async def test_a_routing_id_stays_bound_to_the_first_key_that_used_it(pair, swarm):
    """A second connection under a routing id that stage 0's key used, proving stage 2's key."""
    a, b = pair
    _, ids = swarm
    ctx = zmq.asyncio.Context()
    try:
        def dealer(identity: PeerIdentity) -> zmq.asyncio.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, b"stage0.0000cafe")
            sock.setsockopt(zmq.CURVE_SERVERKEY, z85.encode(split_contact(b.endpoint)[1]))
            sock.setsockopt(zmq.CURVE_PUBLICKEY, identity.curve.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, identity.curve.secret)
            sock.connect(split_contact(b.endpoint)[0])
            return sock

        first = dealer(ids[0])
        await first.send_multipart([b"first"])
        assert (await b.recv(timeout_s=5))[1] == [b"first"]
        first.close(linger=0)  # ZeroMQ frees the routing id once it sees the close; the key binding stays
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30  # a loaded machine: ZeroMQ may take seconds to free the closed id
        while b.mismatched_keys == 0 and loop.time() < deadline:
            # A fresh connection per try: while the closed one still holds the id, ZeroMQ parks the
            # new connection and does not look at it again, however much is sent on it.
            second = dealer(ids[2])
            await second.send_multipart([b"second"])
            with pytest.raises(NetTimeoutError):
                await b.recv(timeout_s=0.5)
            second.close(linger=0)
        assert b.mismatched_keys >= 1 and b.peer_key("stage0.0000cafe") == ids[0].key.curve_public
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------- certified records
def record(stage: int, value: object, *, expiration: float | None = None, subkey: object = "12D3Koo") -> DHTRecord:
    return DHTRecord(DHTID.generate(source=stage_key(RUN, stage)).to_bytes(), MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), time.time() + 30 if expiration is None else expiration)


def signed_by(identity: PeerIdentity, r: DHTRecord) -> DHTRecord:
    (validator,) = dht_validators(identity)
    return dataclasses.replace(r, value=validator.sign_value(r))


def checker(swarm, **kw) -> CertifiedRecordValidator:
    local, _ = swarm
    (validator,) = dht_validators(TrustedAuthority(RUN, local.authority.public, **kw))
    return validator


def test_a_record_of_a_certified_peer_for_its_stage_validates_and_strips_to_its_value(swarm):
    _, ids = swarm
    r = record(1, contact("tcp://10.0.0.2:5000", ids[1].key.curve_public))
    s = signed_by(ids[1], r)
    v = checker(swarm)
    assert v.validate(s) and v.strip_value(s) == r.value
    assert v.validate(signed_by(ids[1], record(1, "")))  # a tombstone
    assert signed_by(ids[0], r).value != s.value  # each peer signs with its own key


def test_a_member_cannot_announce_another_stage_another_key_or_a_far_expiry(swarm):
    local, ids = swarm
    v = checker(swarm)
    addr = "tcp://10.0.0.9:5000"
    forged = {
        "stage 1 by stage 2's peer": signed_by(ids[2], record(1, contact(addr, ids[2].key.curve_public))),
        "stage 1 at stage 1's key, by stage 2": signed_by(ids[2], record(1, contact(addr, ids[1].key.curve_public))),
        "its own stage at another's key": signed_by(ids[2], record(2, contact(addr, ids[1].key.curve_public))),
        "a bare endpoint (no key to pin)": signed_by(ids[2], record(2, addr)),
        "a far expiry": signed_by(ids[2], record(2, contact(addr, ids[2].key.curve_public),
                                                 expiration=time.time() + CERTIFIED_MAX_TTL_S + 60)),
        "no subkey": signed_by(ids[2], record(2, "", subkey=None)),
        "another run's key": dataclasses.replace(
            signed_by(ids[2], record(2, "")), key=DHTID.generate(source=stage_key("other", 2)).to_bytes()),
    }
    honest = signed_by(ids[2], record(2, contact(addr, ids[2].key.curve_public)))
    tampered = dataclasses.replace(honest, value=MSGPackSerializer.dumps(contact("tcp://6.6.6.6:1", ids[2].key.curve_public))
                                   + honest.value[len(MSGPackSerializer.dumps(contact(addr, ids[2].key.curve_public))):])
    forged["a changed endpoint"] = tampered
    forged["a later expiration"] = dataclasses.replace(honest, expiration_time=honest.expiration_time + 1)
    forged["unsigned"] = record(2, contact(addr, ids[2].key.curve_public))
    assert v.validate(honest)
    assert {name: v.validate(r) for name, r in forged.items()} == dict.fromkeys(forged, False)


def test_records_of_another_authority_are_refused_and_a_revoked_certificates_read_as_withdrawn(swarm, tmp_path):
    local, ids = swarm
    stranger = issue_local(tmp_path, run_id=RUN, num_stages=2)
    theirs = load_identity(stranger.key_file(1), stranger.cert_file(1), run_id=RUN, stage=1)
    r = record(1, contact("tcp://10.0.0.2:5000", theirs.key.curve_public))
    assert not checker(swarm).validate(signed_by(theirs, r))
    plain = record(1, contact("tcp://10.0.0.2:5000", ids[1].key.curve_public))
    mine = signed_by(ids[1], plain)
    revoked = verify_revocations(revoke(local.authority, [ids[1].body.serial], run_id=RUN),
                                 authority=local.authority.public, run_id=RUN)
    assert checker(swarm).validate(mine) and checker(swarm).strip_value(mine) == plain.value
    knows = checker(swarm, revoked=set(revoked.serials))  # reads it as withdrawn (see the validator's docstring)
    assert knows.validate(mine) and knows.strip_value(mine) == MSGPackSerializer.dumps("")


def test_a_record_cannot_outlive_its_certificate(swarm):
    local, _ = swarm
    key = PeerKey(bytes(range(7, 39)))
    cert = issue(local.authority, make_request(key, "brief", [0]), run_id=RUN, valid_s=20)
    from mapl_swarm.net.identity import CertificateBody, Signed

    brief = PeerIdentity(key, cert, CertificateBody.decode(cert.body))
    assert isinstance(brief.cert, Signed)
    ok = signed_by(brief, record(0, contact("tcp://h:1", key.curve_public), expiration=time.time() + 10))
    late = signed_by(brief, record(0, contact("tcp://h:1", key.curve_public), expiration=time.time() + 60))
    assert checker(swarm).validate(ok) and not checker(swarm).validate(late)



def test_a_peers_dht_node_reads_the_records_of_a_certificate_revoked_while_it_runs_as_withdrawn(swarm, tmp_path,
                                                                                                 monkeypatch):
    """A peer's validator re-reads its revocation list file when it changes (in the DHT's own
    process: at most every ``REVOCATION_POLL_S``, 0 here), so a record readable before the list
    names its certificate reads as withdrawn after it (SPEC §7.2 item 8)."""
    from mapl_swarm.net.identity import write_signed

    local, ids = swarm
    lists = tmp_path / "revoked.list"
    write_signed(lists, revoke(local.authority, [], run_id=RUN, now=1000))
    me = load_identity(local.key_file(0), local.cert_file(0), run_id=RUN, stage=0, revocations=lists)
    (validator,) = dht_validators(me)
    monkeypatch.setattr("mapl_swarm.net.identity.REVOCATION_POLL_S", 0.0)
    theirs = signed_by(ids[1], record(1, contact("tcp://10.0.0.2:5000", ids[1].key.curve_public)))
    assert validator.validate(theirs) and validator.strip_value(theirs) != MSGPackSerializer.dumps("")
    write_signed(lists, revoke(local.authority, [ids[1].body.serial], run_id=RUN, now=2000), force=True)
    assert validator.validate(theirs) and validator.strip_value(theirs) == MSGPackSerializer.dumps("")  # withdrawn
    other = signed_by(ids[0], record(0, contact("tcp://10.0.0.1:5000", ids[0].key.curve_public)))
    assert validator.strip_value(other) != MSGPackSerializer.dumps("")


def test_a_replica_record_stands_only_at_its_signers_own_peer_id_and_stage(swarm):
    """Replica records (SPEC §9.1): under stage k's averaging keys, a subkey is the signer's own
    libp2p peer id (derived from its certificate) and the certificate allows stage k."""
    _, ids = swarm
    v = checker(swarm)

    def replica(identity: PeerIdentity, stage: int, subkey_of: PeerIdentity, which: int = 1) -> DHTRecord:
        r = DHTRecord(DHTID.generate(source=member_keys(RUN, stage)[which]).to_bytes(),
                      MSGPackSerializer.dumps(libp2p_peer_id(subkey_of.key.sign_public)), MSGPackSerializer.dumps(1.0),
                      time.time() + 30)
        return signed_by(identity, r)

    own = replica(ids[1], 1, ids[1])
    assert v.validate(own) and v.strip_value(own) == MSGPackSerializer.dumps(1.0)
    assert v.validate(replica(ids[1], 1, ids[1], which=0))  # matchmaking
    now = time.time()
    assert v.refusal(replica(ids[1], 1, ids[2]), now) == "not_own_peer_id"
    assert v.refusal(replica(ids[2], 1, ids[2]), now) == "stage_not_allowed"
    assert v.refusal(record(1, "", subkey=libp2p_peer_id(ids[1].key.sign_public)), now) == "unsigned"


def test_a_dht_node_takes_an_identity_file_or_key_not_both():
    from mapl_swarm.errors import ConfigError
    from mapl_swarm.net.dht_node import start_dht

    with pytest.raises(ConfigError, match="identity file or an identity key"):
        start_dht(identity_path="id.key", identity_key=b"k")
