"""A revoked replica that ignores the revocation is cut off by its neighbours within seconds (issue 46).

Three stages, two replicas of stage 1, real processes. Every peer but replica (1, 1) watches the
authority's revocation list; (1, 1) plays a dishonest member that never reads it. Once its serial is
revoked (the list replaced on the hosts), its neighbours cut it off as they cut off a revoked chain
member: each logs it within a few seconds (the list is polled every 2 s), its HELLOs are refused
from then on, its partner averages without it, and the swarm trains on with the stage's other
replica. Nobody pauses, and nobody calls (1, 0) its stage's last replica.
"""

from __future__ import annotations

import re

import pytest

from mapl_swarm.net.identity import CertificateBody, read_signed, revoke, write_signed

from swarm_helpers import ReplicaSwarm, steps_done, wait_steps

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

CUT_OFF_S = 15.0
"""Deadline for a neighbour to cut the revoked replica off: the list is polled every 2 s."""


def test_a_revoked_replica_that_ignores_the_list_is_cut_off_within_seconds(tmp_path):
    with ReplicaSwarm(tmp_path, "replica-revoked", steps=1000, identities=[1, 2, 1], initial=(1, 2, 1)) as swarm:
        revoked = tmp_path / "revoked.list"
        write_signed(revoked, revoke(swarm.local.authority, [], run_id="replica-revoked", now=1000))
        watching = ["--revocations", str(revoked), "--set", "net.heartbeat_interval_s=0.5"]
        honest = {key: swarm.start(*key, *watching) for key in [(0, 0), (1, 0), (2, 0)]}
        dishonest = swarm.start(1, 1, "--set", "net.heartbeat_interval_s=0.5")  # never reads the list
        wait_steps(swarm.out, 3, [*honest.values(), dishonest], 240)

        serial = CertificateBody.decode(read_signed(swarm.local.cert_file(1, 1), "certificate").body).serial
        write_signed(revoked, revoke(swarm.local.authority, [serial], run_id="replica-revoked",
                                     previous=read_signed(revoked, "revocations")), force=True)
        cut = rf"certificate \(serial {serial}\) is revoked"
        for key in [(0, 0), (2, 0)]:  # its neighbours, each within the deadline
            honest[key].wait_for(cut, CUT_OFF_S)
        done = steps_done(swarm.out)
        wait_steps(swarm.out, done + 4, list(honest.values()), 240)  # the swarm trains on without it

        for key, proc in honest.items():
            out = proc.output
            assert "last replica" not in out and "pausing" not in out, (key, out[-3000:])
        # nothing after the cut-off welcomes it again: no later line of a neighbour names its contact
        # but to refuse it
        for key in [(0, 0), (2, 0)]:
            out = honest[key].output
            line = re.search(rf"the replica of stage 1 at (\S+) left \(left: its {cut}", out)
            assert line is not None, out[-3000:]
            later = out[line.end():].splitlines()
            assert not [x for x in later if line.group(1) in x and "refus" not in x.lower()], later
