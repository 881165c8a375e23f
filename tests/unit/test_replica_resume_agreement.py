"""The resume agreement of a run with replicas (SPEC §9.10 item 13), over in-memory links: every
replica of every stage gets the same step (one all of them hold) or the same refusal, whatever
steps each replica holds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mapl_swarm.errors import CheckpointError, MaplError, MissingCheckpoints
from mapl_swarm.peer.link import Links
from mapl_swarm.peer.replica_resume import ReplicaResume


def grid(saved: list[list[list[int]]], reasons: dict[tuple[int, int], str] | None = None, *, run_steps: int = 10):
    """A swarm of ``len(saved)`` stages, ``saved[k][r]`` the usable steps of replica r of stage k;
    every replica's agreement, run together: each one's (step, epoch) or the exception it raised."""
    reasons = reasons or {}
    P = len(saved)
    agreements: dict[tuple[int, int], ReplicaResume] = {}
    rounds: dict[int, dict[str, tuple[list[int], str]]] = {k: {} for k in range(P)}
    filled = {k: asyncio.Event() for k in range(P)}

    def stage_round(k: int, r: int):
        async def gather(steps, why):  # the stage's gather: every starting replica's, once all are in
            rounds[k][f"peer{k}.{r}"] = (sorted(steps), why)
            if len(rounds[k]) == len(saved[k]):
                filled[k].set()
            await filled[k].wait()
            return dict(rounds[k])
        return gather

    def send_from(k: int, r: int):
        async def send(link, meta):  # deliver on the receiver's link back to (k, r)
            other = agreements[link.stage, link.replica]
            back = other.links.named(f"stage{k}.{r}")
            assert other.on_message(SimpleNamespace(meta=dict(meta)), back) is None
        return send

    for k in range(P):
        for r in range(len(saved[k])):
            links = Links(k - 1 if k > 0 else None, k + 1 if k < P - 1 else None)
            for n in (k - 1, k + 1):
                if 0 <= n < P:
                    for q in range(len(saved[n])):
                        links.add(SimpleNamespace(name=f"stage{n}.{q}", stage=n, replica=q))
            agreements[k, r] = ReplicaResume(f"stage{k}.{r}", k, links, send_from(k, r), stage_round(k, r))

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(
            a.agree(saved[k][r], reasons.get((k, r)), run_steps=run_steps, epoch=k, timeout_s=5.0)
            for (k, r), a in agreements.items()), return_exceptions=True), 10)

    return dict(zip(agreements, asyncio.run(main())))


def test_every_replica_resumes_from_the_newest_step_its_stages_current_replicas_hold(caplog):
    with caplog.at_level("WARNING", logger="mapl_swarm.peer.replica_resume"):
        got = grid([[[2, 4, 6], [2, 4, 6]],
                    [[2, 4, 6], [2, 4]],        # this replica lost its step 6: it is behind, not waited for
                    [[4, 6], [2, 4, 6]]])       # this one joined at step 4
    assert set(got.values()) == {(6, 2)}, got  # the run epoch: the largest of all (stage 2's here)
    # the replica behind is named at each replica of its stage, with what happens to it (issue 45)
    said = {r.getMessage() for r in caplog.records if r.getMessage().startswith("stage1.")}
    assert len(said) == 2 and all(m.endswith(
        ": replica(s) peer1.1 of stage 1 hold no checkpoint newer than step 4, the stage's current replica(s) hold "
        "step 6: the swarm does not roll back to them; they take a current replica's state when the run starts "
        "(their own files are kept)") for m in said), said
    assert not any(r.getMessage().startswith("stage2.") for r in caplog.records)  # stage 2 holds the same newest


@pytest.mark.parametrize("stage1", [[[2, 4], []], [[], [2, 4], [2]]])
def test_a_replica_without_files_beside_a_current_one_does_not_stop_the_resume(stage1):
    """A replica started with --resume on a fresh host (no copy of its stage's folder) while a partner
    holds the stage's files: the swarm resumes from the newest step; the bare replica loads a
    partner's state in the sync round instead of making every peer exit (issue 45)."""
    got = grid([[[2, 4]], stage1, [[2, 4]]])
    assert set(got.values()) == {(4, 2)}, got


def test_replicas_of_different_counts_per_stage_agree():
    got = grid([[[3, 6]], [[3, 6], [3, 6], [6]]])
    assert set(got.values()) == {(6, 1)}, got


@pytest.mark.parametrize("saved, reasons, says", [
    ([[[2]], [[4], [2, 4]]], {}, "no checkpoint step that every stage has"),
    ([[[2, 4]], [[2, 4], [2, 4]]], {(1, 1): "stage 1: written with another config"}, "written with another config"),
    ([[[10]], [[10]]], {}, "nothing to train"),
])
def test_a_refusal_reaches_every_replica_with_one_reason(saved, reasons, says):
    got = grid(saved, reasons)
    assert all(isinstance(v, CheckpointError) for v in got.values()), got
    assert len({str(v) for v in got.values()}) == 1 and says in str(next(iter(got.values())))


def test_a_stage_whose_replicas_lack_its_files_is_named_with_the_files_to_copy():
    """The replacement of stage 1's lost last replica came to a host without stage 1's folder while
    stages 0 and 2 hold step 4: every replica gets the same refusal naming stage 1 and the files
    (CHECKPOINT resume ``missing``), so after a re-form the others pause instead of stopping."""
    got = grid([[[2, 4], [2, 4]], [[]], [[2, 4]]])
    assert all(isinstance(v, MissingCheckpoints) and v.stages == [1] for v in got.values()), got
    assert len({str(v) for v in got.values()}) == 1
    assert str(got[1, 0]).startswith("stage 1 holds no checkpoint of this run in every replica's folder, but every "
                                     "other stage holds step 4: copy checkpoints/step_00000004/stage_1.pt, "
                                     "stage_1.manifest.json from the run.out_dir of a replica of stage 1")


def test_decisions_that_differ_stop_the_replica_that_got_them():
    links = Links(0, None)
    for q in range(2):
        links.add(SimpleNamespace(name=f"stage0.{q}", stage=0))

    async def stage_round(steps, why):
        return {"me": (list(steps), why)}

    async def main():
        sent = []

        async def send(link, meta):
            sent.append((link.name, meta))

        a = ReplicaResume("stage1.0", 1, links, send, stage_round)
        for q, step in enumerate((4, 2)):  # two stage-0 replicas that decided differently
            assert a.on_message(SimpleNamespace(meta={"phase": "resume", "step": step, "epoch": 0}),
                                links.named(f"stage0.{q}")) is None
        with pytest.raises(CheckpointError, match="decided different resume steps"):
            await a.agree([2, 4], None, run_steps=10, epoch=0, timeout_s=5.0)
        return sent

    sent = asyncio.run(main())
    assert [name for name, meta in sent] == ["stage0.0", "stage0.1"]
    assert all(meta["phase"] == "offer" and meta["steps"] == [2, 4] and meta["have"] == {"1": [2, 4]}
               for _, meta in sent)


def test_a_checkpoint_from_the_wrong_side_is_not_taken_and_silence_times_out():
    links = Links(0, 2)
    up, down = SimpleNamespace(name="stage0.0", stage=0), SimpleNamespace(name="stage2.0", stage=2)
    links.add(up)
    links.add(down)

    async def stage_round(steps, why):
        return {"me": (list(steps), why)}

    async def send(link, meta):
        pass

    a = ReplicaResume("stage1.0", 1, links, send, stage_round)
    assert "from stage 0" in a.on_message(SimpleNamespace(meta={"phase": "offer", "steps": [1]}), up)
    assert "from stage 2" in a.on_message(SimpleNamespace(meta={"phase": "resume", "step": 1}), down)
    assert "saved" in a.on_message(SimpleNamespace(meta={"phase": "saved", "step": 1}), down)
    with pytest.raises(MaplError, match="no checkpoint offer from stage2.0 within 0.2 s"):
        asyncio.run(a.agree([1], None, run_steps=10, epoch=0, timeout_s=0.2))
