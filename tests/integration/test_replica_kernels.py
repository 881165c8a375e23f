"""Replicas on other CPU kernels train together without re-syncing (issue 46; SPEC §9.10 item 6).

AdamW steps to other last bits on ``ATEN_CPU_CAPABILITY=default`` than on this machine's best
instruction set, so replicas on mixed hardware never hold equal parameter digests. Three replicas
of stage 1, real processes, the third on the default kernels: every round is whole (their
parameters are close: the same frame, per-tensor sums within 1e-5), no step is redone and no state
downloaded, and the run ends as one on uniform hardware does; with MAPL+VQ the neighbours take
the replicas' full codebook slices of a version as the same slice (SPEC §5.1). With MAPL the
replicas check every share of every step (``replicas.check_fraction = 1``, SPEC §9.10 item 15):
each one recomputed on other kernels checks out, and nobody is excluded. Before the
closeness rule the default-kernel replica re-synced at every step and the stage redid nearly every
step; before the rounding allowance the neighbours counted every other replica's slice as stale.
"""

from __future__ import annotations

import os

import pytest
import torch

from mapl_swarm.launch import replica_out_dir
from mapl_swarm.pipeline import checkpoint

from swarm_helpers import ReplicaSwarm

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

STEPS = 30


@pytest.mark.parametrize("codec", ["mapl", "mapl_vq"])
def test_replicas_on_other_cpu_kernels_take_every_step_without_a_resync(tmp_path, codec):
    with ReplicaSwarm(tmp_path, "replica-kernels", steps=STEPS, identities=[1, 3, 1], initial=(1, 3, 1),
                      codec=codec) as swarm:
        checking = ("--set", "replicas.check_fraction=1.0") if codec == "mapl" else ()  # VQ cannot be checked
        for key in [(0, 0), (1, 0), (1, 1), (2, 0)]:
            swarm.start(*key, *checking)
        swarm.start(1, 2, *checking, env=dict(os.environ, ATEN_CPU_CAPABILITY="default"))
        codes = {key: p.proc.wait(360) for key, p in swarm.procs.items()}
        assert all(code == 0 for code in codes.values()), {k: p.output[-3000:] for k, p in swarm.procs.items()}
        for r in range(3):
            res = swarm.result(1, r)
            assert res["end"] == "finished" and res["averaging"]["rounds"] == STEPS, res
            assert res["averaging"].get("resyncs", 0) == 0, res["averaging"]
        for key, proc in swarm.procs.items():
            assert "is redone" not in proc.output, (key, proc.output[-3000:])
            assert "is not its work" not in proc.output and "is excluded" not in proc.output, \
                (key, proc.output[-3000:])
        if checking:  # each replica checked its partners' shares (all but the last few steps')
            for r in range(3):
                found = swarm.result(1, r)["checking"]
                assert found["shares_checked"] >= STEPS and found["shares_wrong"] == 0, found
        for stage in (0, 2):  # MAPL+VQ: the replicas' full slices of a version are the same to rounding
            assert not swarm.result(stage, 0)["codebooks"].get("rejected"), swarm.result(stage, 0)["codebooks"]
        # the kernels did round differently: the replicas' final parameters differ, and only in rounding
        ours, theirs = (checkpoint.load_stage(replica_out_dir(swarm.out, r), STEPS, 1)["modules"] for r in (0, 2))
        floats = [k for k, v in ours.items() if v.is_floating_point()]
        assert any(not torch.equal(ours[k], theirs[k]) for k in floats)
        assert all(torch.allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6) for k in floats)
