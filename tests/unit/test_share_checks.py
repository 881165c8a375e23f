"""Replicas check each other's work: the draw, the verdicts, the exclusion, the comparison (SPEC §9.10 item 15)."""

from __future__ import annotations

import math
import secrets

import pytest
import torch

from mapl_swarm.errors import ConfigError
from mapl_swarm.replicas.checker import pack_inputs, unpack_inputs
from mapl_swarm.replicas.work import KeptParts, read_request, request
from mapl_swarm.step.checking import Accusations, divergent, drawn, stubborn
from mapl_swarm.step.rounds import ReplicaStep, Verdict, commitment, read_round, read_verdicts

from conftest import micro_config

PEERS = ("p1", "p2", "p3")


def round_of(step: int, *, commits=None, reveals=None, verdicts=None, group=PEERS) -> ReplicaStep:
    return ReplicaStep("p1", tuple(group), {p: "d" for p in group}, {p: (i,) for i, p in enumerate(group)}, 0.0,
                       steps={p: step for p in group}, epochs={p: 0 for p in group},
                       contacts={p: f"tcp://{p}" for p in group}, commits=commits or {}, reveals=reveals or {},
                       verdicts=verdicts or {})


def pair(nonces: dict[str, bytes], step: int = 4) -> tuple[ReplicaStep, ReplicaStep]:
    """A round that committed to ``nonces`` and the next round revealing them."""
    return (round_of(step, commits={p: commitment(n) for p, n in nonces.items()}),
            round_of(step + 1, reveals=dict(nonces)))


def test_the_draw_checks_each_share_at_the_rate_every_member_reads_alike_and_withholding_never_helps():
    hits = {p: 0 for p in PEERS}
    for _ in range(600):
        prior, now = pair({p: secrets.token_bytes(32) for p in PEERS})
        got = drawn(prior, now, 0.2)
        assert got == drawn(prior, now, 0.2)  # every member computes the same
        for p in got:
            hits[p] += 1
    assert all(80 <= n <= 160 for n in hits.values()), hits  # 120 expected of 600
    prior, now = pair({p: secrets.token_bytes(32) for p in PEERS})
    assert drawn(prior, now, 0.0) == []
    assert drawn(prior, now, 1.0) == list(PEERS)
    # a member that withholds its nonce, or reveals another, is drawn every time
    for forged in ({}, {"p3": secrets.token_bytes(32)}):
        for _ in range(20):
            prior, now = pair({p: secrets.token_bytes(32) for p in PEERS})
            now = round_of(5, reveals={**{p: n for p, n in now.reveals.items() if p != "p3"}, **forged})
            assert "p3" in drawn(prior, now, 0.01)
    # a member that left, or one alone, is not drawn (nobody can check it)
    prior, now = pair({p: bytes(32) for p in PEERS})
    assert drawn(prior, round_of(5, reveals=now.reveals, group=("p1", "p2")), 1.0) == ["p1", "p2"]
    assert drawn(round_of(4, group=("p1",)), round_of(5, group=("p1",)), 1.0) == []


def test_a_member_is_excluded_on_the_word_of_more_than_half_of_the_round_and_never_on_ones():
    acc = Accusations()
    wrong = (Verdict("p3", 4, False),)
    assert acc.add(round_of(5, verdicts={"p1": wrong})) == []  # one accuser of three: logged, not acted on
    assert acc.add(round_of(6, verdicts={"p1": wrong, "p3": (Verdict("p1", 4, False),)})) == []  # a counter-accusation
    assert acc.add(round_of(6, verdicts={"p2": wrong})) == [("p3", 4, frozenset({"p1", "p2"}))]
    assert acc.add(round_of(7, verdicts={"p1": wrong, "p2": wrong})) == []  # once
    assert acc.excluded == {"p3"}
    # a member's verdict on itself, and "ok" verdicts, count for nothing; two replicas never exclude
    two = Accusations()
    assert two.add(round_of(5, group=("p1", "p2"), verdicts={"p1": (Verdict("p2", 4, False),),
                                                           "p2": (Verdict("p2", 4, False),)})) == []
    assert Accusations().add(round_of(5, verdicts={"p1": (Verdict("p3", 4, True),),
                                                   "p2": (Verdict("p3", 4, True),)})) == []


def test_verdicts_are_read_from_the_gathered_data_only_when_well_formed():
    assert read_verdicts([["p2", 3, False], ["p3", 3, True]]) == (Verdict("p2", 3, False), Verdict("p3", 3, True))
    for bad in ([["p2", -1, False]], [["p2", 3, 0]], [["p2", 3]], "x", [[b"p2", 3, True]], [["p", 1, True]] * 65):
        assert read_verdicts(bad) is None
    gathered = {"digest": "d", "micro": [0], "loss": 0.0, "epoch": 0, "contact": "c", "step": 2, "expected": 2}
    r = read_round("a", {"a": {**gathered, "audit": [["b", 1, False]]}, "b": {**gathered, "audit": "junk"}})
    assert r.verdicts == {"a": (Verdict("b", 1, False),)}


def test_a_checker_compares_its_own_part_of_a_share_less_the_ranges_it_cannot_recompute():
    share = torch.arange(10, dtype=torch.float32)
    kept = KeptParts(4, {"x": [share[4:6].clone(), share[6:8].clone()]})  # values 4..7 came to this reducer
    same = kept.compare("x", share)
    assert (same.values, same.difference, same.relative) == (4, 0.0, 0.0)
    other = share.clone()
    other[5] += 3.0
    assert kept.compare("x", other).difference == pytest.approx(3.0)
    assert kept.compare("x", other, skip=[(5, 6)]).values == 3 and kept.compare("x", other, skip=[(5, 6)]).difference == 0
    assert kept.compare("y", share) is None  # nothing of that member here
    assert math.isinf(kept.compare("x", share[:6]).difference)  # a recomputation too short for the part


def test_inputs_and_requests_survive_their_encoding_and_malformed_ones_are_refused():
    inputs = {3: {"fwd": {"act": torch.ones(2, 3), "ids": torch.zeros(2, 4, dtype=torch.int32)},
                  "bwd": {"grad": torch.full((2, 3), 2.0)}}, 1: {"fwd": {"ids": torch.arange(5)}}}
    meta, tensors = pack_inputs(inputs)
    back = unpack_inputs(meta, tensors)
    assert sorted(back) == [1, 3] and torch.equal(back[3]["bwd"]["grad"], inputs[3]["bwd"]["grad"])
    assert unpack_inputs({"fields": [[1, "side", "x"]]}, tensors[:1]) is None
    assert unpack_inputs({"fields": meta["fields"]}, tensors[:-1]) is None
    assert read_request(request(7, 2)) == (7, 2)
    assert read_request(b"\x93") is None and read_request(request(7, 2)[:-1]) is None


def test_check_fraction_is_a_probability_and_needs_a_codec_without_streamed_codebooks():
    assert micro_config(replicas={"enabled": True, "check_fraction": 0.05}).replicas.check_fraction == 0.05
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ConfigError, match="check_fraction"):
            micro_config(replicas={"enabled": True, "check_fraction": bad})
    with pytest.raises(ConfigError, match="streamed codebooks"):
        micro_config(replicas={"enabled": True, "check_fraction": 0.1},
                     compression={"codec": "mapl_vq", "vq": {"update": "step"}})


def test_the_payload_digest_is_pinned_and_a_signed_work_verifies_only_as_what_was_sent(tmp_path):
    """SPEC §9.10 item 15: the digest of the ``act_train_signed`` vector's tensors (what an
    independent client must compute), and a member's signature of its ACT, which verifies for its
    stage, kind, step, micro-batch and bytes only."""
    from mapl_swarm.net.identity import CertificateError, issue_local, load_identity
    from mapl_swarm.wire.golden.samples import samples
    from mapl_swarm.wire.message import payload_digest

    act = samples()["act_train_signed"]
    digest = payload_digest(act.tensors)
    assert digest.hex() == "7e130b2a048dd1ea33206addf3639557be4e4002e8af181b17469cc6adb33f2c"
    local = issue_local(tmp_path, run_id="run-work", num_stages=2)
    sender, checker = (load_identity(local.key_file(s), local.cert_file(s), run_id="run-work", stage=s) for s in (0, 1))
    proof = {"cert": sender.encoded_cert, "sig": sender.sign_work("ACT", 12, 3, digest)}
    assert checker.verify_work(proof, kind="ACT", step=12, micro=3, digest=digest, stage=0).name == sender.body.name
    for wrong in (dict(kind="GRAD"), dict(step=13), dict(micro=4), dict(digest=bytes(32)), dict(stage=1)):
        with pytest.raises(CertificateError):
            checker.verify_work(proof, **{**dict(kind="ACT", step=12, micro=3, digest=digest, stage=0), **wrong})
    checker.revoked.add(sender.body.serial)  # revoked since: what it sent is still its word
    assert checker.verify_work(proof, kind="ACT", step=12, micro=3, digest=digest, stage=0)


def test_a_member_that_holds_other_parameters_in_two_rounds_in_a_row_is_stubborn():
    def digests(**held: str) -> ReplicaStep:
        r = round_of(5)
        return ReplicaStep("p1", PEERS, {p: held.get(p, "d") for p in PEERS}, r.micro, 0.0, steps=r.steps,
                           epochs=r.epochs, contacts=r.contacts)

    once, again, fixed = digests(p3="x"), digests(p3="y"), digests()
    assert divergent(once) == {"p3"} and divergent(fixed) == set()
    assert stubborn(again, once) == ["p3"]  # it was to load the stage's state after the first
    assert stubborn(fixed, once) == [] and stubborn(once, fixed) == [] and stubborn(once, None) == []
    tie = ReplicaStep("p1", ("p1", "p2"), {"p1": "a", "p2": "b"}, {"p1": (0,), "p2": (1,)}, 0.0)
    assert divergent(tie) == set()  # nobody's digest is the stage's: no exclusion with two replicas
