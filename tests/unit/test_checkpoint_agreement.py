"""CheckpointAgreement (SPEC §5.2) driven without sockets: saves and messages in any order."""

import asyncio
import json
import random

import pytest
import torch

from mapl_swarm.errors import CheckpointError, MissingCheckpoints
from mapl_swarm.peer.checkpoints import CheckpointAgreement
from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.checkpoint import StageCheckpoints
from mapl_swarm.wire import Message, MessageType, decode, encode

from checkpoint_damage import flip_tensor_byte, truncate

P = 3


class _Queues(dict):
    """Per-link FIFO queues of messages ((src, dst) -> list) that wake a waiting pump on arrival;
    ``sent`` keeps every message sent, (src, dst, meta), in order."""

    event: asyncio.Event | None = None

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, int, dict]] = []

    def arrived(self) -> None:
        if self.event is not None:
            self.event.set()


async def _begin(policy, send, caps, **kw):
    """What the peer does after the handshake: the agreement's ``send`` and the neighbours'
    capabilities, then the run policy's ``begin``."""
    policy.agreement.send = send
    policy.agreement.neighbours(caps)
    return await policy.begin(**kw)


def _swarm(root, keep=2, driver="swarm"):
    """P agreements whose messages go through the real wire codec into per-link FIFO queues."""
    queues = _Queues()
    peers = []
    for s in range(P):
        store = StageCheckpoints(root / f"host{s}", s, driver=driver, fingerprint="f" * 32, keep=keep)

        def send(dst, meta, src=s):
            msg = Message(type=MessageType.CHECKPOINT, run_id="t", src=src, dst=dst, step=meta.get("step") or 0,
                          meta=meta)
            queues.setdefault((src, dst), []).append(decode(encode(msg)))  # a valid frame every time
            queues.sent.append((src, dst, dict(meta)))
            queues.arrived()

        async def asend(dst, meta, src=s):
            send(dst, meta, src)

        peers.append(CheckpointAgreement(store, s, P, asend))
    return peers, queues


@pytest.mark.parametrize("seed", range(12))
def test_saved_and_complete_in_any_order(tmp_path, seed):
    rng = random.Random(seed)
    peers, queues = _swarm(tmp_path)
    steps = [2, 4, 6, 8]
    saves = {s: list(steps) for s in range(P)}  # each stage saves in step order, interleaved at random

    async def run():
        while any(saves.values()) or any(queues.values()):
            choices = [("save", s) for s in range(P) if saves[s]] + [("msg", k) for k, q in queues.items() if q]
            kind, who = rng.choice(choices)
            if kind == "save":
                step = saves[who].pop(0)
                peers[who].store.save(step, {"x": torch.full((1,), float(step))})
                await peers[who].on_saved(step)
            else:
                msg = queues[who].pop(0)
                await peers[who[1]].on_message(msg)

    asyncio.run(run())
    for p in peers:
        assert p.declared == set(steps)
        assert p.store.local_steps() == [6, 8]  # keep = 2; nothing newer than the newest complete lost
        assert checkpoint.read_complete(p.store.root, p.stage) == [6, 8]


def test_prune_waits_for_the_slowest_stage(tmp_path):
    peers, queues = _swarm(tmp_path, keep=1)

    async def run():
        for step in (2, 4):
            for s in (0, 1):
                peers[s].store.save(step, {"x": torch.zeros(1)})
                await peers[s].on_saved(step)
        assert not queues.get((1, 0))  # stage 1 has not heard from stage 2: nothing forwarded
        assert peers[0].declared == set() and peers[0].store.local_steps() == [2, 4]
        peers[2].store.save(2, {"x": torch.zeros(1)})
        await peers[2].on_saved(2)
        await peers[1].on_message(queues[(2, 1)].pop(0))
        await peers[0].on_message(queues[(1, 0)].pop(0))
        assert peers[0].declared == {2}
        assert peers[0].store.local_steps() == [2, 4]  # 4 is newer than the newest complete step: kept

    asyncio.run(run())


async def _pump(peers, queues):
    """Deliver every queued message, in each link's order, whenever one arrives (until cancelled)."""
    while True:
        await queues.event.wait()
        queues.event.clear()
        for (src, dst), q in list(queues.items()):
            while q:
                await peers[dst].on_message(q.pop(0))


def _resume_all(peers, queues, run_steps, *, epochs=None, rejoin=False):
    """Every stage's ``agree_resume``: (step, epoch) each, or the error each raised."""
    async def run():
        queues.event = asyncio.Event()
        queues.event.set()  # deliver whatever is already queued
        pumper = asyncio.create_task(_pump(peers, queues))
        try:
            return await asyncio.gather(*(p.agree_resume(run_steps, 10.0, epoch=(epochs or {}).get(s, 0), rejoin=rejoin)
                                          for s, p in enumerate(peers)), return_exceptions=True)
        finally:
            pumper.cancel()

    return asyncio.run(run())


def test_resume_agrees_on_the_newest_common_step(tmp_path):
    peers, queues = _swarm(tmp_path, keep=5)
    have = {0: [2, 4, 6], 1: [2, 4], 2: [4, 6]}
    for s, steps in have.items():
        for step in steps:
            peers[s].store.save(step, {"x": torch.zeros(1)})
    assert _resume_all(peers, queues, 10) == [(4, 0)] * 3


def test_a_rejoin_agrees_on_the_largest_run_epoch_of_any_stage(tmp_path):
    """SPEC "Rejoin": the survivors re-formed (epochs 2 and 1), the replacement starts at 0; every
    stage ends with step 4 and epoch 2."""
    peers, queues = _swarm(tmp_path, keep=5)
    for s in range(3):
        for step in (2, 4):
            peers[s].store.save(step, {"x": torch.zeros(1)})
    assert _resume_all(peers, queues, 10, epochs={0: 1, 1: 0, 2: 2}, rejoin=True) == [(4, 2)] * 3


def test_stage_0_rolls_back_past_a_complete_step_whose_loss_never_reached_it(tmp_path, caplog):
    """Every stage saved steps 2, 4 and 6, but the departure came between stage 0's save of step 6
    and the last stage's REPORT of it: the swarm resumes from step 4, so the loss history has no
    hole. When no common step has its loss, the newest is used anyway, and the gap is logged."""
    peers, queues = _swarm(tmp_path, keep=5)
    for p in peers:
        for step in (2, 4, 6):
            p.store.save(step, {"x": torch.zeros(1)})
    peers[0].without_loss = lambda steps: steps & {6}
    with caplog.at_level("WARNING"):
        assert _resume_all(peers, queues, 10, epochs={0: 1, 1: 1, 2: 1}, rejoin=True) == [(4, 1)] * 3
    assert "checkpoint step 6 is complete but its train loss never reached stage 0" in caplog.text
    assert "resuming from step 4 instead" in caplog.text
    peers, queues = _swarm(tmp_path, keep=5)  # the same folders; no history at all (the metrics file is gone)
    peers[0].without_loss = lambda steps: set(steps)
    assert _resume_all(peers, queues, 10) == [(6, 0)] * 3
    assert "no train loss of checkpoint step(s) [2, 4, 6]; resuming from step 6 anyway" in caplog.text


def test_a_rejoin_without_a_common_step_starts_again_from_step_0_where_a_resume_is_refused(tmp_path):
    peers, queues = _swarm(tmp_path, keep=5)
    peers[0].store.save(2, {"x": torch.zeros(1)})  # the departure came before the others saved step 2
    assert _resume_all(peers, queues, 10, epochs={0: 1, 1: 1, 2: 1}, rejoin=True) == [(0, 1)] * 3
    peers, queues = _swarm(tmp_path / "b", keep=5)
    peers[0].store.save(2, {"x": torch.zeros(1)})
    assert all(isinstance(r, CheckpointError) for r in _resume_all(peers, queues, 10))


def test_resume_refusal_reaches_every_stage_with_what_each_had(tmp_path):
    peers, queues = _swarm(tmp_path)
    for s, steps in {0: [2], 1: [4], 2: [4]}.items():
        for step in steps:
            peers[s].store.save(step, {"x": torch.zeros(1)})
    results = _resume_all(peers, queues, 10)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert len({str(r) for r in results}) == 1
    assert "stage 0 has [2], stage 1 has [4], stage 2 has [4]" in str(results[0])


def test_resume_beyond_run_steps_and_foreign_files_are_refused_everywhere(tmp_path):
    peers, queues = _swarm(tmp_path)
    for p in peers:
        p.store.save(40, {"x": torch.zeros(1)})
    results = _resume_all(peers, queues, 12)
    assert all("checkpoint at step 40 >= run.steps 12: nothing to train" in str(r) for r in results), results

    peers, queues = _swarm(tmp_path / "b")
    for p in peers:
        p.store.save(4, {"x": torch.zeros(1)})
    peers[1].store.driver = "train"  # stage 1's files were written by swarm peers, it now runs as train
    results = _resume_all(peers, queues, 12)
    assert all(isinstance(r, CheckpointError) and "driver swarm vs train" in str(r) for r in results), results


def test_older_neighbour_without_the_capability(tmp_path, make_config):
    """A neighbour that did not advertise checkpoint_agreement gets no CHECKPOINT: a fresh run trains
    without pruning, a resume is refused (no agreement possible)."""
    from types import SimpleNamespace

    from mapl_swarm.errors import MaplError
    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread

    cfg = make_config(run={"out_dir": str(tmp_path)}, pipeline={"num_stages": 2}, checkpoint={"interval_steps": 1})
    data = SimpleNamespace(meta={}, tokenizer=SimpleNamespace(file_hash="h"))
    sent = []

    async def send(dst, meta):
        sent.append(meta)

    runtime = SimpleNamespace(state_dict=lambda: {"x": torch.zeros(1)})

    async def run(resume):
        compute = ComputeThread("stage1")
        policy = PeerRunPolicy(cfg, 1, data, "f" * 32, resume=resume, runtime=runtime, compute=compute)
        try:
            assert await _begin(policy, send, {0: {"1f1b"}}) == 0
            await policy.step_end(1, {})
        finally:
            policy.close()
            compute.close()

    asyncio.run(run(False))
    assert sent == [] and checkpoint.stage_steps(tmp_path, 1) == [1]
    with pytest.raises(MaplError, match=r"cannot agree on a resume step: neighbour stage\(s\) \[0\] do not take part"):
        asyncio.run(run(True))


def test_a_rejoin_after_stage_0_saved_a_step_before_its_report_resumes_from_the_one_before(tmp_path,
                                                                                           make_config):
    """Regression (issue 13): stage 0 saves step 2 at its step end, the swarm declares it complete,
    then stage 1 departs before its REPORT of step 2 arrives. The next session's resume skips step 2,
    so the metrics history (read from stage 0's own file) keeps every loss and no step is lost."""
    from types import SimpleNamespace

    from mapl_swarm.peer.checkpoints import CHECKPOINT_CAPABILITY, PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread

    cfg = make_config(run={"out_dir": str(tmp_path), "steps": 6}, pipeline={"num_stages": 2},
                      checkpoint={"interval_steps": 1})
    data = SimpleNamespace(meta={}, tokenizer=SimpleNamespace(file_hash="h"))
    sent, loaded = [], []
    weights = {"x": torch.zeros(1)}

    async def send(dst, meta):
        sent.append(meta)

    def from_stage_1(meta):
        return Message(type=MessageType.CHECKPOINT, run_id="t", src=1, dst=0, step=meta.get("step") or 0, meta=meta)

    runtime = SimpleNamespace(state_dict=lambda: {k: v.clone() for k, v in weights.items()},
                              load_state_dict=loaded.append)

    async def session(resume, body):
        compute = ComputeThread("stage0")
        policy = PeerRunPolicy(cfg, 0, data, "f" * 32, resume=resume, runtime=runtime, compute=compute)
        try:
            return await body(policy)
        finally:
            policy.close()  # as the peer does at the end of every session
            compute.close()

    async def first(policy):
        assert await _begin(policy, send, {1: {CHECKPOINT_CAPABILITY}}) == 0
        for step in (1, 2):
            weights["x"].fill_(step)
            await policy.step_end(step, {"lr_mult": 1.0})
            await policy.agreement.on_message(from_stage_1({"phase": "saved", "step": step}))
            if step == 1:
                policy.train_loss(1, 4.25, 64)
        assert policy.newest_complete == 2  # complete, but stage 1 left before its REPORT of step 2

    async def rejoin(policy):
        await policy.agreement.on_message(from_stage_1({"phase": "offer", "steps": [1, 2], "have": {"1": [1, 2]}, "epoch": 1}))
        return await _begin(policy, send, {1: {CHECKPOINT_CAPABILITY}}, epoch=1, rejoin=True)

    asyncio.run(session(False, first))
    assert asyncio.run(session(True, rejoin)) == 1
    assert sent[-1] == {"phase": "resume", "step": 1, "epoch": 1}
    assert [state["x"].item() for state in loaded] == [1.0]
    records = [json.loads(x) for x in (tmp_path / "metrics_stage0.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("loss")) for r in records] == [(1, 4.25)]


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest"])
def test_only_verified_steps_are_offered_so_every_stage_can_load_the_agreed_one(tmp_path, damage):
    """Stage 1's copy of the newest step is damaged: every stage agrees on the previous one, and
    every stage's file of it loads."""
    peers, queues = _swarm(tmp_path, keep=5)
    for p in peers:
        for step in (2, 4):
            p.store.save(step, {"w": torch.randn(32, 16), "stage": p.stage})
    pt = tmp_path / "host1" / "checkpoints" / "step_00000004" / "stage_1.pt"
    if damage == "flip":
        flip_tensor_byte(pt)
    elif damage == "truncate":
        truncate(pt)
    else:
        pt.with_name("stage_1.manifest.json").unlink()
    assert [p.store.usable_steps() for p in peers] == [[2, 4], [2], [2, 4]]
    assert _resume_all(peers, queues, 10) == [(2, 0)] * 3
    for p in peers:
        assert p.store.load(2)["stage"] == p.stage


def test_a_peer_that_cannot_save_a_step_does_not_offer_it_and_does_not_wait_for_it(tmp_path, make_config,
                                                                                    monkeypatch, caplog):
    """A full disk at stage 0's final checkpoint: one warning, no ``saved``/``complete`` for the step,
    and ``finish`` does not wait for an agreement that cannot come."""
    import errno
    from types import SimpleNamespace

    from mapl_swarm.peer.checkpoints import CHECKPOINT_CAPABILITY, PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread

    cfg = make_config(run={"out_dir": str(tmp_path), "steps": 2}, pipeline={"num_stages": 2},
                      checkpoint={"interval_steps": 1}, net={"timeout_s": 5.0})
    data = SimpleNamespace(meta={}, tokenizer=SimpleNamespace(file_hash="h"))
    sent = []

    async def send(dst, meta):
        sent.append(meta)

    def full_disk(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    runtime = SimpleNamespace(state_dict=lambda: {"x": torch.zeros(1)})

    async def run():
        compute = ComputeThread("stage0")
        policy = PeerRunPolicy(cfg, 0, data, "f" * 32, resume=False, runtime=runtime, compute=compute)
        try:
            assert await _begin(policy, send, {1: {CHECKPOINT_CAPABILITY}}) == 0
            await policy.step_end(1, {})
            await policy.agreement.on_message(Message(type=MessageType.CHECKPOINT, run_id="t", src=1, dst=0, step=1,
                                                      meta={"phase": "saved", "step": 1}))
            assert sent == [{"phase": "complete", "step": 1}]
            monkeypatch.setattr(checkpoint.torch, "save", full_disk)
            await policy.step_end(2, {})
            await policy.agreement.on_message(Message(type=MessageType.CHECKPOINT, run_id="t", src=1, dst=0, step=2,
                                                      meta={"phase": "saved", "step": 2}))
            await asyncio.wait_for(policy.finish(), 1.0)
            assert policy.unsaved_reason(2).startswith(f"stage 0: checkpoint step 2 not saved under {tmp_path} (")
        finally:
            policy.close()
            compute.close()

    with caplog.at_level("WARNING"):
        asyncio.run(run())
    assert sent == [{"phase": "complete", "step": 1}]  # step 2 never declared complete
    assert checkpoint.stage_steps(tmp_path, 0) == [1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint step 2 of stage 0 not saved: no space left")


# ---------------------------------------------------------------- a step a stage cannot save (1.5)
def _unsaved(queues, src, dst):
    return [meta for s, d, meta in queues.sent if (s, d) == (src, dst) and meta["phase"] == "unsaved"]


async def _save_all(peers, step, failing=()):
    """Every stage saves ``step`` (last stage first), but those in ``failing``, which cannot."""
    for p in reversed(peers):
        if p.stage in failing:
            await p.on_unsaved(step, f"stage {p.stage}: no space left on device at /disk{p.stage}")
        else:
            p.store.save(step, {"x": torch.full((1,), float(step))})
            await p.on_saved(step)


@pytest.mark.parametrize("bad", [1, 2])
def test_a_final_step_a_stage_cannot_save_ends_stage_0s_wait_at_once(tmp_path, caplog, bad):
    """Stage ``bad`` (middle or last) cannot save the final step 4: stage 0, already waiting for it,
    returns well within its timeout with one warning naming that stage; step 4 is complete nowhere
    and kept nowhere, step 2 stays the newest complete step everywhere."""
    peers, queues = _swarm(tmp_path, keep=5)

    async def run():
        queues.event = asyncio.Event()
        pumper = asyncio.create_task(_pump(peers, queues))
        try:
            await _save_all(peers, 2)
            assert await asyncio.wait_for(peers[0].wait_complete(2, 60.0), 5.0) is True
            waiting = asyncio.create_task(peers[0].wait_complete(4, 60.0))
            await asyncio.sleep(0)  # stage 0 is waiting before any stage saves step 4
            assert not waiting.done()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await _save_all(peers, 4, failing={bad})
            assert await asyncio.wait_for(waiting, 5.0) is False
            return loop.time() - t0
        finally:
            pumper.cancel()

    with caplog.at_level("WARNING", logger="mapl_swarm.peer.checkpoints"):
        elapsed = asyncio.run(run())
    assert elapsed < 2.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert warnings == [f"checkpoint step 4 will never be complete (stage {bad}: no space left on device at "
                        f"/disk{bad}); the newest complete checkpoint stays step 2"]
    reason = f"stage {bad}: no space left on device at /disk{bad}"
    assert _unsaved(queues, 1, 0) == [{"phase": "unsaved", "step": 4, "reason": reason}]  # relayed unchanged
    assert _unsaved(queues, 2, 1) == ([{"phase": "unsaved", "step": 4, "reason": reason}] if bad == 2 else [])
    assert not any(meta == {"phase": "saved", "step": 4} for s, d, meta in queues.sent if s == 1)
    assert not any(meta["phase"] == "complete" and meta["step"] == 4 for _, _, meta in queues.sent)
    for p in peers:  # every stage heard stage 0 give step 4 up (abandoned), and deleted its files of it
        assert p.declared == {2} and p.store.complete == [2]
        assert p.unsaved == {4: reason} and p.store.local_steps() == [2]


@pytest.mark.parametrize("seed", range(8))
def test_unsaved_steps_in_any_order_are_complete_nowhere_and_said_once_per_link(tmp_path, seed):
    """Saves, failed saves and messages interleaved at random; stage 1 fails step 4, stage 2 fails
    step 4 too and step 8: one ``unsaved`` per link and step, those steps complete nowhere, the others
    everywhere."""
    rng = random.Random(seed)
    peers, queues = _swarm(tmp_path, keep=10)
    steps = [2, 4, 6, 8]
    fails = {1: {4}, 2: {4, 8}}
    todo = {s: list(steps) for s in range(P)}

    async def run():
        while any(todo.values()) or any(queues.values()):
            choices = [("save", s) for s in range(P) if todo[s]] + [("msg", k) for k, q in queues.items() if q]
            kind, who = rng.choice(choices)
            if kind == "save":
                step = todo[who].pop(0)
                if step in fails.get(who, ()):
                    await peers[who].on_unsaved(step, f"stage {who}: disk full")
                else:
                    peers[who].store.save(step, {"x": torch.zeros(1)})
                    await peers[who].on_saved(step)
            else:
                await peers[who[1]].on_message(queues[who].pop(0))

    asyncio.run(run())
    for p in peers:
        assert p.declared == {2, 6}
    assert set(peers[0].unsaved) == {4, 8} and peers[0].unsaved[8] == "stage 2: disk full"
    assert peers[0].unsaved[4] in ("stage 1: disk full", "stage 2: disk full")  # whichever came first
    assert [m["step"] for m in _unsaved(queues, 2, 1)] == [4, 8]
    assert sorted(m["step"] for m in _unsaved(queues, 1, 0)) == [4, 8]
    # stage 0 gave them up: said once per link downstream, and no stage keeps a file of them
    for link in ((0, 1), (1, 2)):
        assert sorted(m["step"] for s, d, m in queues.sent if (s, d) == link and m["phase"] == "abandoned") == [4, 8]
    for p in peers:
        assert p.store.local_steps() == [2, 6] and set(p.unsaved) == {4, 8}


def test_unsaved_from_the_wrong_side_is_ignored_and_not_sent_to_an_older_neighbour(tmp_path, caplog):
    from mapl_swarm.peer.checkpoints import CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY

    peers, queues = _swarm(tmp_path)

    async def run():
        await peers[1].on_message(Message(type=MessageType.CHECKPOINT, run_id="t", src=0, dst=1, step=4,
                                          meta={"phase": "unsaved", "step": 4, "reason": "stage 0: x"}))
        assert peers[1].unsaved == {} and queues.sent == []
        peers[2].neighbours({1: {CHECKPOINT_CAPABILITY}})  # stage 1 did not advertise checkpoint_unsaved (1.4)
        await peers[2].on_unsaved(4, "stage 2: disk full")
        assert peers[2].unsaved == {4: "stage 2: disk full"} and queues.sent == []
        peers[0].neighbours({1: {CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY}})  # no checkpoint_abandoned (1.5)
        await peers[0].on_unsaved(6, "stage 0: disk full")
        assert peers[0].abandoned == {6} and queues.sent == []
        await peers[1].on_message(Message(type=MessageType.CHECKPOINT, run_id="t", src=2, dst=1, step=8,
                                          meta={"phase": "abandoned", "step": 8, "reason": "stage 0: x"}))
        assert peers[1].abandoned == set() and queues.sent == []

    with caplog.at_level("WARNING"):
        asyncio.run(run())
    assert "ignored CHECKPOINT unsaved from stage 0 (expected from stage 2)" in caplog.text
    assert "ignored CHECKPOINT abandoned from stage 2 (expected from stage 0)" in caplog.text


def _policy_run(tmp_path, make_config, stage, caps, body, *, num_stages=2, timeout_s=60.0):
    """``body(policy, sent)`` on stage ``stage``'s :class:`PeerRunPolicy` (checkpoint every step),
    begun with neighbour capabilities ``caps``; returns what it sent, (dst, meta) each."""
    from types import SimpleNamespace

    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread

    cfg = make_config(run={"out_dir": str(tmp_path), "steps": 2}, pipeline={"num_stages": num_stages},
                      checkpoint={"interval_steps": 1}, net={"timeout_s": timeout_s})
    data = SimpleNamespace(meta={}, tokenizer=SimpleNamespace(file_hash="h"))
    runtime = SimpleNamespace(state_dict=lambda: {"x": torch.zeros(1)})
    sent = []

    async def send(dst, meta):
        sent.append((dst, dict(meta)))

    async def run():
        compute = ComputeThread(f"stage{stage}")
        policy = PeerRunPolicy(cfg, stage, data, "f" * 32, resume=False, runtime=runtime, compute=compute)
        try:
            assert await _begin(policy, send, caps) == 0
            await body(policy, sent)
        finally:
            policy.close()
            compute.close()

    asyncio.run(run())
    return sent


def _full_disk(obj, f):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("takes_unsaved", [True, False])
def test_a_stage_whose_disk_is_full_says_so_upstream(tmp_path, make_config, monkeypatch, takes_unsaved):
    """The last stage saves step 1, then its disk is full at step 2: ``saved 1``, then ``unsaved 2``
    with a reason naming the stage, the step and where — only to an upstream neighbour advertising
    ``checkpoint_unsaved`` (a 1.4 one would reject the phase)."""
    from mapl_swarm.peer.checkpoints import CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY

    caps = {CHECKPOINT_CAPABILITY, *((CHECKPOINT_UNSAVED_CAPABILITY,) if takes_unsaved else ())}
    seen = {}

    async def body(policy, sent):
        assert CHECKPOINT_UNSAVED_CAPABILITY in policy.agreement.capabilities
        await policy.step_end(1, {})
        monkeypatch.setattr(checkpoint.torch, "save", _full_disk)
        await policy.step_end(2, {})
        seen.update(saved=policy.saved(2), reason=policy.unsaved_reason(2), other=policy.unsaved_reason(1))

    sent = _policy_run(tmp_path, make_config, 1, {0: caps}, body)
    reason = seen["reason"]
    assert reason.startswith(f"stage 1: checkpoint step 2 not saved under {tmp_path} (") and " free of " in reason
    assert seen["saved"] is False and seen["other"] is None
    assert sent == [(0, {"phase": "saved", "step": 1}),
                    *([(0, {"phase": "unsaved", "step": 2, "reason": reason})] if takes_unsaved else [])]
    assert checkpoint.stage_steps(tmp_path, 1) == [1]


def test_stage_0_finishes_at_once_when_a_stage_could_not_save_the_final_step(tmp_path, make_config, caplog):
    """Stage 0 saved the final step 2 but stage 1 could not: ``finish`` ends at once (not after
    ``net.timeout_s``), the run's newest complete checkpoint stays step 1, and the policy says why."""
    seen = {}

    def msg(meta):
        return Message(type=MessageType.CHECKPOINT, run_id="t", src=1, dst=0, step=meta["step"], meta=meta)

    async def body(policy, sent):
        await policy.step_end(1, {})
        await policy.agreement.on_message(msg({"phase": "saved", "step": 1}))
        await policy.step_end(2, {})
        finishing = asyncio.create_task(policy.finish())
        await asyncio.sleep(0)
        assert not finishing.done()  # waiting for step 2's agreement
        await policy.agreement.on_message(msg({"phase": "unsaved", "step": 2, "reason": "stage 1: disk full at /d1"}))
        await asyncio.wait_for(finishing, 2.0)
        seen.update(reason=policy.unsaved_reason(2), newest=policy.newest_complete, saved=policy.saved(2))

    from mapl_swarm.peer.checkpoints import CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY

    with caplog.at_level("WARNING"):
        sent = _policy_run(tmp_path, make_config, 0, {1: {CHECKPOINT_CAPABILITY, CHECKPOINT_UNSAVED_CAPABILITY}},
                           body, timeout_s=120.0)
    assert sent == [(1, {"phase": "complete", "step": 1})]
    assert seen == {"reason": "stage 1: disk full at /d1", "newest": 1, "saved": True}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert warnings == ["checkpoint step 2 will never be complete (stage 1: disk full at /d1); the newest "
                        "complete checkpoint stays step 1"]
    assert checkpoint.stage_steps(tmp_path, 0) == [1]  # its own file of step 2 is deleted: it was given up


def test_a_stage_without_files_is_refused_when_a_complete_step_exists(tmp_path):
    """A replacement on a fresh host (no checkpoint at all) while every stage had saved step 4:
    every stage stops with a message naming step 4 and the files to copy; no stage rolls back to
    step 0 (which would delete the others' checkpoints), none deletes anything."""
    peers, queues = _swarm(tmp_path, keep=5)
    for s in (0, 2):
        for step in (2, 4):
            peers[s].store.save(step, {"x": torch.zeros(1)})
    for step in (2, 4):
        peers[0].store.mark_complete(step)
    results = _resume_all(peers, queues, 10, epochs={0: 1, 1: 0, 2: 1}, rejoin=True)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert str(results[1]) == str(results[0]) == str(results[2])
    assert str(results[1]).startswith("stage 1 has no checkpoint of this run, but every stage saved step 4: copy "
                                      "checkpoints/step_00000004/stage_1.pt, stage_1.manifest.json from the run.out_dir")
    assert all(isinstance(r, MissingCheckpoints) and r.stages == [1] for r in results)  # CHECKPOINT resume `missing`
    assert [p.store.local_steps() for p in peers] == [[2, 4], [], [2, 4]]


def test_a_re_forming_swarm_waits_on_when_the_replacement_lacks_its_stages_files(tmp_path):
    """After a departure the survivors re-form (``rejoining``): a replacement of stage 1 started with
    ``--resume`` on a host without stage 1's checkpoint folder stops, naming the files to copy; the
    survivors do not exit but pause again, the swarm waiting for another replacement (issue 45)."""
    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.peer.runtime import Peer
    from mapl_swarm.pipeline.stage import StageRuntime
    from types import SimpleNamespace

    from peer_fakes import FakeNet, link_neighbours, sampler, serve_all, swarm_config

    def cfg_of(out):
        return swarm_config(pipeline={"num_stages": 3}, run={"steps": 4, "out_dir": str(out)},
                            checkpoint={"interval_steps": 2}, net={"rejoin_timeout_s": 30.0})

    async def main():
        net = FakeNet()
        transports = [net.transport(f"stage{s}") for s in range(3)]
        data = SimpleNamespace(meta={}, tokenizer=SimpleNamespace(file_hash="h"))

        async def resolve(stage, timeout_s):
            return f"mem://stage{stage}"

        async def announce(endpoint):
            return None

        peers = []
        for s in range(3):
            cfg = cfg_of(tmp_path / ("fresh-host" if s == 1 else "hosts02"))
            rt, compute = StageRuntime(cfg, s), ComputeThread(f"stage{s}")
            policy = PeerRunPolicy(cfg, s, data, "f" * 32, resume=True, runtime=rt, compute=compute)
            if s != 1:  # the survivors saved steps 2 and 4, which stage 0 knows complete
                for step in (2, 4):
                    policy.store.save(step, {"x": torch.zeros(1)})
                    if s == 0:
                        policy.store.mark_complete(step)
            peers.append(Peer(cfg, s, rt, fingerprint="f" * 32, resolve=resolve, announce=announce,
                              sampler=sampler(cfg) if s == 0 else None, compute=compute, run_policy=policy,
                              epoch=0 if s == 1 else 1, rejoining=s != 1))
            link_neighbours(peers[-1])
        return await serve_all(peers, transports, timeout_s=60)

    results = asyncio.run(main())
    assert isinstance(results[1], MissingCheckpoints) and results[1].stages == [1], results[1]
    assert str(results[1]).startswith("stage 1 has no checkpoint of this run, but every stage saved step 4: copy ")
    for r in (results[0], results[2]):
        assert not isinstance(r, BaseException) and r.end == "rejoin", r
        assert r.epoch == 2 and "the replacement of stage(s) [1] cannot resume: stage 1 has no checkpoint" in r.rejoins[0]
    assert checkpoint.stage_steps(tmp_path / "hosts02", 0) == [2, 4]  # nothing rolled back or moved aside


def test_a_stage_whose_disk_stays_full_is_named_everywhere_and_the_others_keep_only_what_can_complete(
        tmp_path, monkeypatch):
    """A 3-stage in-memory swarm checkpointing every step (keep 2) whose stage 1 cannot save any step
    from 3 on: every stage ends naming stage 1, the newest complete step stays 2, and no stage keeps
    a file of a later step (stage 0 gave each up: CHECKPOINT ``abandoned``)."""
    from peer_fakes import policy_swarm, serve_all, swarm_config

    real_save = StageCheckpoints.save

    def save(self, step, state):
        if self.stage == 1 and step >= 3:  # what StageCheckpoints.save does on a full disk
            return False
        return real_save(self, step, state)

    monkeypatch.setattr(StageCheckpoints, "save", save)
    cfg = swarm_config(pipeline={"num_stages": 3}, run={"steps": 7, "out_dir": str(tmp_path)},
                       checkpoint={"interval_steps": 1, "keep": 2})

    async def main():
        net, peers, transports = policy_swarm(cfg)
        return await serve_all(peers, transports)

    results = asyncio.run(main())
    assert [r.end for r in results] == ["finished"] * 3, results
    for s, r in enumerate(results):
        assert checkpoint.stage_steps(tmp_path, s) == [1, 2], s
        assert r.checkpoint_note.startswith("checkpoint of step 7 is not complete (stage 1: ") and \
            "the newest complete checkpoint is step 2" in r.checkpoint_note, r.checkpoint_note


def test_a_replicas_own_averaging_state_is_saved_and_loaded_with_its_checkpoint(tmp_path, make_config):
    """SPEC §9.10 item 16: a replica's error feedback and PowerSGD factors (its averaging's
    ``own_state``) go into each of its checkpoints, and loading a step hands them back."""
    from types import SimpleNamespace

    from mapl_swarm.peer.checkpoints import PeerRunPolicy
    from mapl_swarm.peer.compute import ComputeThread

    cfg = make_config(run={"out_dir": str(tmp_path)}, pipeline={"num_stages": 2}, checkpoint={"interval_steps": 1})
    data = SimpleNamespace(meta={}, tokenizer=SimpleNamespace(file_hash="h"))
    loaded: list = []
    runtime = SimpleNamespace(state_dict=lambda: {"x": torch.zeros(1)}, load_state_dict=lambda state: None)
    own = {"scheme": "powersgd", "errors": [torch.full((2, 2), 3.0)], "factors": [torch.ones(2, 1)]}
    averaging = SimpleNamespace(own_state=lambda: own, load_own_state=loaded.append)
    compute = ComputeThread("stage1")
    try:
        policy = PeerRunPolicy(cfg, 1, data, "f" * 32, resume=False, runtime=runtime, compute=compute,
                               averaging=averaging)
        assert policy._save(3)
        policy._load(3)
    finally:
        compute.close()
    assert checkpoint.load_stage(tmp_path, 3, 1)["averaging"]["scheme"] == "powersgd"
    assert len(loaded) == 1 and torch.equal(loaded[0]["errors"][0], own["errors"][0])
    assert torch.equal(loaded[0]["factors"][0], own["factors"][0])
