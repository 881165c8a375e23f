"""Who is a member of a stage's averaging and what a group's members may declare (SPEC §9.10 item 6,
``replicas/members.py``)."""

from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

from mapl_swarm.replicas.members import DIAL_OUT_PRIORITY, group_refusal, member_records

A, B, C = (PeerID(bytes([0, 4, 1, 2, 3, n])) for n in (1, 2, 3))
NODE, CLIENT = AveragingMode.NODE.value, AveragingMode.CLIENT.value


def test_members_are_the_numeric_records_and_the_dial_out_ones_declared_minus_one():
    entries = {A.to_bytes(): ValueWithExpiration(0.0, 1.0), B.to_bytes(): ValueWithExpiration(DIAL_OUT_PRIORITY, 1.0),
               C.to_bytes(): ValueWithExpiration(True, 1.0), "text": ValueWithExpiration(0.0, 1.0)}
    assert member_records(entries) == (frozenset({A, B}), frozenset({B}))


def test_a_group_is_refused_for_a_bandwidth_of_its_own_or_an_undeclared_client():
    fair = [None, NODE, b""]
    assert group_refusal({A: fair, B: fair}, frozenset(), sparse=False) is None
    assert "bandwidth or mode of their own" in group_refusal({A: fair, B: [1e9, NODE, b""]}, frozenset(), sparse=False)
    shirker = [None, CLIENT, b""]  # reduces nothing, yet never said it dials out
    assert "bandwidth or mode of their own" in group_refusal({A: fair, B: shirker}, frozenset(), sparse=False)
    assert group_refusal({A: fair, B: shirker}, frozenset({B}), sparse=False) is None


def test_topk_takes_one_dial_out_member_at_most():
    fair, client = [None, NODE, b""], [None, CLIENT, b""]
    assert group_refusal({A: fair, B: client}, frozenset({B, C}), sparse=True) is None
    assert group_refusal({A: fair, B: client, C: client}, frozenset({B, C}), sparse=False) is None
    assert "cannot reach each other" in group_refusal({A: fair, B: client, C: client}, frozenset({B, C}), sparse=True)
