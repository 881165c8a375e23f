"""Who is a member of a stage's averaging and what a group's members may declare (SPEC §9.10 item 6).

Pure rules, kept apart from :class:`~.averaging.StageAverager` (which applies them in hivemind's
averager process): a stage's members are the certified subkeys of its ``all_averagers`` key, a
dial-out member among them declares :data:`DIAL_OUT_PRIORITY`; in a group every member declares
no bandwidth and mode ``NODE``, but a dial-out member, which declares mode ``CLIENT`` and so
reduces no part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hivemind.averaging.allreduce import AveragingMode
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

__all__ = ["DIAL_OUT_PRIORITY", "member_records", "group_refusal"]

DIAL_OUT_PRIORITY = -1.0
"""The value a dial-out member (``net.reachable = "no"``, hivemind's client mode) declares under
``all_averagers``; a member that serves state declares ``0.0`` (its state-sharing priority)."""


def member_records(entries: Mapping[Any, Any]) -> tuple[frozenset[PeerID], frozenset[PeerID]]:
    """(the members, those of them that dial out) of the subkeys and values a DHT read of
    ``all_averagers`` returned: a member's value is a number (not a boolean)."""
    declared = {PeerID(sub): v.value for sub, v in entries.items()
                if isinstance(sub, bytes) and isinstance(v, ValueWithExpiration)
                and isinstance(v.value, (int, float)) and not isinstance(v.value, bool)}
    return frozenset(declared), frozenset(p for p, value in declared.items() if value == DIAL_OUT_PRIORITY)


def group_refusal(declared: Mapping[PeerID, Any], dial_out: frozenset[PeerID], *, sparse: bool) -> str | None:
    """Why a group whose members gathered ``declared`` (hivemind's ``[bandwidth, mode, data]`` each)
    runs no round, or None. hivemind sizes each member's part by the bandwidth it declares: one
    declaring a huge one would reduce (and so choose) nearly all of the stage's update, so replicas
    reduce equal parts, but for dial-out members (``dial_out``: mode ``CLIENT``), which reduce none
    since nobody can send them one. With ``sparse`` (``topk``) every member fetches every other's
    share, which two dial-out members cannot do of each other."""
    node, client = AveragingMode.NODE.value, AveragingMode.CLIENT.value
    odd = {str(p): d[:2] for p, d in declared.items()
           if d[0] is not None or d[1] not in (node, client) or (d[1] == client and p not in dial_out)}
    if odd:
        return (f"member(s) declared a bandwidth or mode of their own (bandwidth, mode): {odd}; the replicas of a "
                f"stage reduce equal parts, but for dial-out members")
    dialing = [str(p) for p, d in declared.items() if d[1] == client]
    if sparse and len(dialing) > 1:
        return (f"dial-out members {dialing} in one topk round: they cannot reach each other for their sparse "
                f"shares (a stage with topk averaging holds one dial-out replica at most; use fp32, fp16 or powersgd)")
    return None
