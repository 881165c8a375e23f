"""Per-peer identities (issue 23 item 1): authority and peer key files, requests, certificates and
every reason a certificate is refused; the ``mapl-swarm keys`` subcommands that make them."""

from __future__ import annotations

import hashlib
import os
import stat

import msgpack
import pytest
import zmq
from zmq.utils import z85

from mapl_swarm.cli import main
from mapl_swarm.errors import ConfigError
from mapl_swarm.net import identity as I

AUTH_SEED, PEER_SECRET, OTHER_SECRET = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
T0 = 1_800_000_000


def _cert(stages=(1,), roles=(), valid_s=86400, **kw):
    request = I.make_request(I.PeerKey(PEER_SECRET), "host-a", [0, 1, 2])
    return I.issue(I.Authority(AUTH_SEED), request, run_id="run1", stages=list(stages), roles=list(roles),
                   valid_s=valid_s, serial=7, now=T0, **kw)


def _verify(cert, **kw):
    args = dict(authority=I.Authority(AUTH_SEED).public, run_id="run1", stage=1, now=T0 + 10)
    return I.verify_certificate(cert, **{**args, **kw})


def test_a_certificate_names_the_peers_own_keys_and_is_the_same_bytes_on_every_machine():
    key = I.PeerKey(PEER_SECRET)
    body = _verify(_cert(roles=["drain"]))
    assert (body.run, body.name, body.stages, body.roles, body.serial) == ("run1", "host-a", (1,), ("drain",), 7)
    assert (body.not_before, body.not_after) == (T0, T0 + 86400)
    assert body.sign_key == key.sign_public and body.authority == I.Authority(AUTH_SEED).public
    assert body.curve_key == z85.decode(zmq.curve_public(key.curve_secret))  # the links' CURVE key
    assert key.curve_public != I.PeerKey(OTHER_SECRET).curve_public
    # Ed25519 signatures and this msgpack encoding are deterministic: a golden digest
    assert hashlib.sha256(_cert(roles=["drain"]).encode()).hexdigest()[:16] == GOLDEN_CERT_DIGEST


GOLDEN_CERT_DIGEST = "302b543ca22d018d"


@pytest.mark.parametrize("change, code", [
    (dict(authority=I.Authority(b"\x09" * 32).public), "wrong_authority"),
    (dict(run_id="run2"), "wrong_run"),
    (dict(stage=3), "stage_not_allowed"),
    (dict(now=T0 - 1), "not_yet_valid"),
    (dict(now=T0 + 86400), "expired"),
])
def test_each_reason_a_certificate_is_refused_has_its_code(change, code):
    with pytest.raises(I.CertificateError) as info:
        _verify(_cert(), **change)
    assert info.value.code == code


def test_a_changed_byte_or_a_request_passed_off_as_a_certificate_fails_the_signature():
    cert = _cert()
    body = msgpack.unpackb(cert.body)
    forged = I.Signed("certificate", msgpack.packb({**body, "stages": [1, 2]}), cert.sig)
    with pytest.raises(I.CertificateError, match="signature") as info:
        _verify(forged, stage=2)
    assert info.value.code == "bad_signature"
    # a peer's own signature over a certificate-shaped body: the contexts differ
    key = I.PeerKey(PEER_SECRET)
    self_signed = I.Signed("certificate", cert.body, key.sign(I.SIGNING_CONTEXT["request"] + cert.body))
    with pytest.raises(I.CertificateError):
        I.Signed("certificate", cert.body, self_signed.sig).verify(I.Authority(AUTH_SEED).public)


@pytest.mark.parametrize("mutate", [
    lambda b: {**b, "extra": 1},
    lambda b: {k: v for k, v in b.items() if k != "roles"},
    lambda b: {**b, "stages": [2, 1]},
    lambda b: {**b, "stages": []},
    lambda b: {**b, "stages": [True]},
    lambda b: {**b, "stages": ["a", 1]},
    lambda b: {**b, "serial": "7"},
    lambda b: {**b, "roles": ["admin"]},
    lambda b: {**b, "sign_key": b"short"},
    lambda b: {**b, "not_after": b["not_before"] + I.MAX_VALIDITY_S + 1},
    lambda b: {**b, "v": 2},
    lambda b: {**b, "name": "bad name"},
])
def test_malformed_bodies_are_refused_before_the_signature_is_checked(mutate):
    cert = _cert()
    body = mutate(msgpack.unpackb(cert.body))
    authority = I.Authority(AUTH_SEED)
    data = msgpack.packb(body)
    signed = I.Signed("certificate", data, authority.sign(I.SIGNING_CONTEXT["certificate"] + data))
    with pytest.raises(I.CertificateError) as info:
        _verify(signed)
    assert info.value.code == "malformed"


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"body": b"x"}),
                                  msgpack.packb({"body": b"x", "sig": b"s"}), b"\x00" * 5000])
def test_received_bytes_that_are_no_signed_body_are_malformed(data):
    with pytest.raises(I.CertificateError) as info:
        I.Signed.decode("certificate", data)
    assert info.value.code == "malformed"


def test_the_authority_grants_only_stages_the_request_asked_for_and_checks_its_signature():
    authority, key = I.Authority(AUTH_SEED), I.PeerKey(PEER_SECRET)
    request = I.make_request(key, "host-a", [1])
    with pytest.raises(I.CertificateError, match=r"stages \[2\] were not requested"):
        I.issue(authority, request, run_id="run1", stages=[2])
    stolen = I.Signed("request", request.body, I.PeerKey(OTHER_SECRET).sign(I.SIGNING_CONTEXT["request"]
                                                                              + request.body))
    with pytest.raises(I.CertificateError) as info:  # another key's request for this key: no proof of it
        I.issue(authority, stolen, run_id="run1")
    assert info.value.code == "bad_signature"
    with pytest.raises(ConfigError, match="valid for 1 s to 366 days"):
        I.issue(authority, request, run_id="run1", valid_s=I.MAX_VALIDITY_S + 1)


def test_key_files_are_0600_and_refused_when_others_may_read_them(tmp_path):
    authority = I.create_authority(tmp_path / "a.key")
    key = I.create_peer_key(tmp_path / "p.key")
    for path in ("a.key", "p.key"):
        assert stat.S_IMODE(os.stat(tmp_path / path).st_mode) == 0o600
    assert I.load_authority(tmp_path / "a.key").public == authority.public
    assert I.load_peer_key(tmp_path / "p.key").curve_public == key.curve_public
    with pytest.raises(ConfigError, match="already exists"):
        I.create_peer_key(tmp_path / "p.key")
    os.chmod(tmp_path / "p.key", 0o640)
    with pytest.raises(ConfigError, match=r"peer key file .*p\.key is readable by others \(mode 0640\)"):
        I.load_peer_key(tmp_path / "p.key")
    os.chmod(tmp_path / "p.key", 0o600)
    with pytest.raises(ConfigError, match=r"is not a run authority key"):  # another kind of key file
        I.load_authority(tmp_path / "p.key")
    assert authority.seed.hex() not in repr(authority) and key.secret.hex() not in repr(key)


def test_request_and_certificate_files_round_trip_and_refuse_other_content(tmp_path):
    cert = _cert()
    I.write_signed(tmp_path / "p.cert", cert)
    assert I.read_signed(tmp_path / "p.cert", "certificate") == cert
    with pytest.raises(ConfigError, match="is not a request"):
        I.read_signed(tmp_path / "p.cert", "request")
    (tmp_path / "bad.cert").write_text(f"{I.CERTIFICATE_HEADER}\nnot base64!\n")
    with pytest.raises(ConfigError, match="not base64"):
        I.read_signed(tmp_path / "bad.cert", "certificate")


def test_keys_subcommands_make_a_certificate_a_peer_accepts_and_print_no_secret(tmp_path, capsys):
    def keys(*args):
        return main(["keys", *[str(a) for a in args]])

    a, p, req, cert = (tmp_path / n for n in ("a.key", "p.key", "p.req", "p.cert"))
    assert keys("authority", "--out", a) == 0 and keys("peer", "--out", p) == 0
    assert keys("request", "--key", p, "--name", "host-b", "--stages", "0,2", "--out", req) == 0
    assert keys("issue", "--authority", a, "--request", req, "--run-id", "demo", "--stages", "2", "--role",
                "drain", "--days", "2", "--out", cert) == 0
    assert keys("show", cert) == 0
    out = capsys.readouterr().out
    assert "'host-b' may serve stage(s) [2] of run 'demo' and drain for 2 day(s)" in out
    for secret in (I.load_authority(a).seed, I.load_peer_key(p).secret):
        assert secret.hex() not in out
    body = I.verify_certificate(I.read_signed(cert, "certificate"), authority=I.load_authority(a).public,
                                run_id="demo", stage=2)
    assert body.curve_key == I.load_peer_key(p).curve_public and body.roles == ("drain",)
    assert keys("issue", "--authority", a, "--request", req, "--run-id", "demo", "--stages", "1", "--out",
                tmp_path / "x.cert") == 2
    assert "stages [1] were not requested (the request asks for [0, 2])" in capsys.readouterr().err
    assert keys() == 2 and "keys: a subcommand (authority, peer" in capsys.readouterr().err


def test_a_revocation_list_grows_supersedes_the_previous_one_and_revokes_by_serial(tmp_path, capsys):
    authority = I.Authority(AUTH_SEED)
    first = I.revoke(authority, [7], run_id="run1", now=T0)
    second = I.revoke(authority, [3], run_id="run1", previous=first, now=T0)  # same second: still later
    body = I.verify_revocations(second, authority=authority.public, run_id="run1")
    assert body.serials == (3, 7) and body.issued == T0 + 1
    with pytest.raises(I.CertificateError) as info:
        _verify(_cert(), revoked=set(body.serials))  # the certificate's serial is 7
    assert info.value.code == "revoked"
    other = I.revoke(I.Authority(b"\x09" * 32), [1], run_id="run1")
    for signed, run, code in [(other, "run1", "wrong_authority"), (second, "run2", "wrong_run")]:
        with pytest.raises(I.CertificateError) as info:
            I.verify_revocations(signed, authority=authority.public, run_id=run)
        assert info.value.code == code
    with pytest.raises(ConfigError, match="at most 200 serials"):
        I.revoke(authority, list(range(I.MAX_REVOKED + 1)), run_id="run1")

    I.create_authority(tmp_path / "a.key")
    path = tmp_path / "revoked.list"
    for serial in ("5", "2"):
        assert main(["keys", "revoke", "--authority", str(tmp_path / "a.key"), "--run-id", "demo", "--serial", serial,
                     "--out", str(path)]) == 0
    assert main(["keys", "show", str(path)]) == 0
    assert "revocation list of run 'demo': serial(s) [2, 5]" in capsys.readouterr().out
