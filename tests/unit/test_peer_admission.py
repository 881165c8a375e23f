"""Who may say what, sessions and sequence numbers, the schedule's window (issue 12, items 2-4).

Real 2-stage swarms on an in-memory network (:mod:`peer_fakes`: no sockets, no sleeps); attacks
are injected at precise points through the network's tap. Each attacked run must finish with the
losses of the clean run, with every forged message dropped and counted by its code.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from mapl_swarm.errors import MaplError, NonFiniteError
from mapl_swarm.peer.result import write_result
from mapl_swarm.pipeline.inprocess import InProcessPipeline
from mapl_swarm.wire import Message, MessageType, WireTensor, decode, encode

from peer_fakes import fake_swarm, on_first, peek, run_swarm, sampler, swarm_config

pytestmark = pytest.mark.timeout(300)

MT = MessageType
EVIL = "stage0.0badc0de"
HELLO = {"fingerprint": "fp", "num_stages": 2, "capabilities": ["1f1b"], "peer": "stage0", "nonce": b"n" * 16,
         "num_micro_batches": 2, "micro_batch_size": 2, "eval_batches": 1}


def _run(cfg=None, setup=None):
    """Run a fresh 2-stage swarm (``setup(net, peers)`` first); returns (net, peers, results)."""

    async def main():
        net, peers, transports = fake_swarm(cfg)
        if setup is not None:
            setup(net, peers)
        return net, peers, await run_swarm(peers, transports)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def clean():
    return _run()


def _reference_losses(cfg) -> list[float]:
    pipe = InProcessPipeline(cfg)
    batches = sampler(cfg)
    return [pipe.train_step([next(batches) for _ in range(cfg.pipeline.num_micro_batches)]).loss
            for _ in range(cfg.run.steps)]


def _msg(mtype, src=0, dst=1, **kw) -> list:
    return encode(Message(type=mtype, run_id="mem", src=src, dst=dst, **kw))


def _act(step=0, micro=0, pver=0, **kw) -> list:
    """A train ACT that fits the run (zeros)."""
    cfg = swarm_config()
    B, T, r = cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.compression.rank
    z = np.zeros((B, T, r), dtype=np.uint16)  # bf16 bit patterns of 0.0
    ids = np.zeros((B, T + 1), dtype=np.uint16)
    return _msg(MT.ACT, step=step, micro=micro, pver=pver, meta={"mode": "train"},
                tensors={"z": WireTensor("bf16", z), "ids": ids}, **kw)


def _type(frames) -> MessageType | None:
    msg = peek(frames)
    return None if msg is None else msg.type


# ---------------------------------------------------------------------- the clean run
def test_clean_swarm_trains_like_one_process_and_keeps_the_session_rules(clean):
    net, peers, results = clean
    cfg = swarm_config()
    assert results[0].train_losses == pytest.approx(_reference_losses(cfg), rel=1e-5)
    assert results[0].rejects == {} and results[1].rejects == {} and results[0].bad_frames == 0
    for a, b in (("stage0", "stage1"), ("stage1", "stage0")):
        sent = [(m, rep) for s, d, m, rep in net.log if s.startswith(a + ".") and d == b]
        own = [m for m, rep in sent if not rep]
        answers = [m for m, rep in sent if rep]
        assert own[0].type == MT.HELLO and own[0].seq == 0
        assert [m.seq for m in own] == list(range(len(own)))  # +1 per message, no gap
        assert [(m.type, m.seq) for m in answers] == [(MT.WELCOME, 0)]  # on the HELLO's connection
        welcome_at = next(i for i, (s, d, m, rep) in enumerate(net.log)
                          if rep and s.startswith(b + ".") and d == a)
        first_hb = next(i for i, (s, d, m, rep) in enumerate(net.log)
                        if s.startswith(a + ".") and d == b and m.type == MT.HEARTBEAT)
        assert first_hb > welcome_at  # no HEARTBEAT before WELCOME
    down = net.messages("stage0", "stage1")
    up = net.messages("stage1", "stage0")
    act_pver = {(m.step, m.micro): m.pver for m in down if m.type == MT.ACT}
    assert max(act_pver.values()) == cfg.run.steps - 1  # mapl: the projector steps every step
    assert {(m.step, m.micro): m.pver for m in up if m.type == MT.GRAD} == act_pver  # GRAD: its ACT's pver
    assert [(m.step, m.pver) for m in up if m.type == MT.PROJ_GRAD] == [(s, s) for s in range(cfg.run.steps)]
    assert [m.step for m in up if m.type == MT.REPORT] == list(range(cfg.run.steps))  # REPORT of step s says s
    assert [(m.step, m.pver) for m in down if m.type == MT.PROJ] == [(s, s) for s in range(cfg.run.steps + 1)]


def test_result_json_counts_rejects_by_code(tmp_path, clean):
    result = clean[2][1]
    result.rejects = {"not_allowed": 2, "replay": 1}
    data = json.loads(write_result(result, tmp_path).read_text())
    assert data["rejects"] == {"not_allowed": 2, "replay": 1}


# ---------------------------------------------------------------------- outsiders and strangers
def test_forged_hello_is_refused_on_its_own_connection_never_to_the_real_neighbour(clean):
    hello_meta = HELLO

    def setup(net, peers):
        def attack(_):
            net.inject("stage1", EVIL, _msg(MT.HELLO, meta=hello_meta))  # a second stage 0 while the first is alive
            net.inject("stage1", "stage0.0000bad2", _msg(MT.HELLO, meta={**hello_meta, "fingerprint": "bogus"}))
        on_first(net, "stage0", MT.ACT, attack)

    net, peers, results = _run(setup=setup)
    assert results[0].train_losses == clean[2][0].train_losses
    assert results[1].rejects == {"stage_taken": 1, "fingerprint_mismatch": 1}
    assert [decode(f).meta["code"] for f in net.orphan_replies[EVIL]] == ["stage_taken"]
    assert [decode(f).meta["code"] for f in net.orphan_replies["stage0.0000bad2"]] == ["fingerprint_mismatch"]
    assert not any(m.type == MT.REJECT for m in net.messages("stage1", "stage0"))  # the real stage 0 heard none


def test_messages_from_strangers_and_other_sessions_are_dropped_and_training_continues(clean):
    report = _msg(MT.REPORT, src=1, dst=0, meta={"loss": 0.123, "tokens": 64, "mode": "train"}, seq=99)

    def setup(net, peers):
        def attack(_):
            for rid in (EVIL, "intruder"):
                net.inject("stage1", rid, _msg(MT.ERROR, seq=50, meta={"code": "internal", "message": "die"}))
                net.inject("stage1", rid, _msg(MT.BYE, seq=51))
                net.inject("stage1", rid, _act(seq=52))
            for _ in range(3):
                net.inject("stage0", "stage1.0badc0de", report)
            net.inject("stage0", "stage1.0badc0de", _msg(MT.ERROR, src=1, dst=0, seq=53,
                                                         meta={"code": "internal", "message": "die"}))
        on_first(net, "stage0", MT.ACT, attack)

    net, peers, results = _run(setup=setup)
    assert results[0].train_losses == clean[2][0].train_losses and len(results[0].train_losses) == 3
    assert results[1].rejects == {"wrong_session": 3, "not_allowed": 3}
    assert results[0].rejects == {"wrong_session": 4}


def test_a_captured_message_replayed_on_its_session_is_dropped(clean):
    captured: dict[MessageType, list] = {}

    def setup(net, peers):
        def tap(sender, dst, frames, reply):
            mtype = _type(frames)
            if sender.startswith("stage0.") and mtype in (MT.ACT, MT.PROJ) and mtype not in captured:
                captured[mtype] = (sender, [bytes(f) for f in frames])
            elif sender.startswith("stage0.") and mtype == MT.ACT and len(captured) == 2 and "done" not in captured:
                captured["done"] = True
                for rid, frames_ in (captured[MT.PROJ], captured[MT.ACT]):
                    net.inject("stage1", rid, frames_)
        net.tap = tap

    net, peers, results = _run(setup=setup)
    assert results[0].train_losses == clean[2][0].train_losses
    assert results[1].rejects == {"replay": 2}


def test_heartbeats_without_a_session_are_counted_but_not_warned_of(caplog):
    """A neighbour's HEARTBEATs queued for a session this peer ended (a stall, a re-form) come before
    the new handshake, on a connection that holds no session: dropped as ``wrong_session``, one
    warning-free debug line each, while an ACT without a session is warned of as before."""
    heartbeat = _msg(MT.HEARTBEAT, seq=1, meta={"t_send": 0.0})

    def stale(net, peers):
        def attack(_):
            for _ in range(3):
                net.inject("stage1", EVIL, heartbeat)
            net.inject("stage1", EVIL, _act(seq=9))
        on_first(net, "stage0", MT.ACT, attack)

    with caplog.at_level("DEBUG", logger="mapl_swarm.peer.admission"):
        _, _, results = _run(setup=stale)
    assert results[1].rejects == {"wrong_session": 4}
    drops = [r for r in caplog.records if "dropped a message from 'stage0.0badc0de'" in r.getMessage()]
    assert [(r.levelno, "HEARTBEAT" in r.getMessage()) for r in drops] == [(10, True)] * 3 + [(30, False)]  # DEBUG, WARNING


# ---------------------------------------------------------------------- insiders: a buggy neighbour
def test_a_neighbour_sending_what_it_may_not_or_outside_the_window_cannot_derail_training(clean):
    """Stage 1 (a key holder) also sends an ACT upstream, a GRAD for a micro-batch never sent, the
    same GRAD twice, REPORTs of steps not reached or twice; stage 0 sends an ACT made with projector
    99 and a second PROJ: all dropped, training unchanged."""

    def setup(net, peers):
        up, down = peers[1].links.upstream, peers[0].links.downstream
        send_grad, send_report, send_act = up.send_grad, up.send_report, down.send_act
        done = set()

        async def grad(step, micro, payload, *, pver):
            await send_grad(step, micro, payload, pver=pver)
            if "grad" not in done:
                done.add("grad")
                await send_grad(step, micro, payload, pver=pver)  # twice
                await send_grad(step, 7, payload, pver=pver)  # a micro-batch stage 0 never sent
                await up.send(MT.ACT, step=step, meta={"mode": "train"})  # ACT flows down only

        async def report(step, meta):
            await send_report(step, meta)
            if "report" not in done:
                done.add("report")
                await send_report(step, {**meta, "loss": 0.123})  # twice
                await send_report(step + 5, {**meta, "loss": 0.123})  # a step not reached

        async def act(step, micro, payload, *, eval_mode, pver):
            await send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)
            if step == 1 and "act" not in done:
                done.add("act")
                await send_act(step, micro + 1, payload, eval_mode=eval_mode, pver=99)  # another projector
                await send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)  # the same micro-batch again
                await down.send(MT.REPORT, step=0, meta={"loss": 0.5, "tokens": 1})  # REPORT flows up only

        up.send_grad, up.send_report, down.send_act = grad, report, act

    net, peers, results = _run(setup=setup)
    assert results[0].train_losses == clean[2][0].train_losses and len(results[0].train_losses) == 3
    assert results[0].rejects == {"out_of_window": 4, "not_allowed": 1}
    assert results[1].rejects == {"stale_projector": 1, "out_of_window": 1, "not_allowed": 1}


def test_what_a_neighbour_says_out_of_place_is_dropped_as_implausible(clean):
    """Stage 1 (a key holder) reports step losses of 1e308 and -1 and more tokens than a step has,
    and says ``retransmit_unavailable`` although stage 0 asked for no retransmission (no VQ here):
    each is dropped as ``implausible`` (SPEC 1.7), stage 0 keeps the real losses and trains on."""

    def setup(net, peers):
        up = peers[1].links.upstream
        send_report = up.send_report
        done = set()

        async def report(step, meta):
            if "report" not in done:
                done.add("report")
                await send_report(step, {**meta, "loss": 1e308})  # finite, absurd
                await send_report(step, {**meta, "loss": -1.0})
                await send_report(step, {**meta, "tokens": 10 ** 6})
                await up.send(MT.ERROR, meta={"code": "retransmit_unavailable", "message": "forged"})
            await send_report(step, meta)

        up.send_report = report

    _, _, results = _run(setup=setup)
    assert results[0].train_losses == clean[2][0].train_losses and len(results[0].train_losses) == 3
    assert results[0].rejects == {"implausible": 4} and results[0].errors == {}


def test_resyncs_beyond_a_steps_payloads_are_implausible_and_an_answer_to_a_forged_one_stops_nobody():
    """With MAPL+VQ, stage 1 (a key holder) asks stage 0 twelve times in one step for a resync and a
    retransmission of a micro-batch of step 0 that stage 0 no longer holds: stage 0 answers the
    first ones it may (its M payloads of the step plus 2) with ERROR ``retransmit_unavailable``, which
    stage 1, awaiting no retransmission, drops as ``implausible``; the others are ``implausible`` at
    stage 0. Nobody stops and the losses are those of one process. The RESYNCs go just before the
    last step's last GRAD: stage 0 has then sent all M payloads of the step and awaits that GRAD, so
    its allowance does not depend on how far its own forwards got."""
    cfg = swarm_config(compression={"codec": "mapl_vq", "vq": {"codebook_size": 16, "kmeans_iters": 2}})
    M = cfg.pipeline.num_micro_batches

    def setup(net, peers):
        up = peers[1].links.upstream
        send_grad, done = up.send_grad, set()

        async def grad(step, micro, payload, *, pver):
            if step == cfg.run.steps - 1 and micro == M - 1 and "resync" not in done:
                done.add("resync")
                for _ in range(12):
                    await up.send(MT.RESYNC, step=0, micro=0, meta={"stream": "act", "have": 0, "reason": "forged",
                                                                   "retransmit": True, "mode": "train"})
            await send_grad(step, micro, payload, pver=pver)

        up.send_grad = grad

    _, _, results = _run(cfg, setup=setup)
    answered = M + 2
    assert results[0].rejects == {"implausible": 12 - answered}
    assert results[1].rejects == {"implausible": answered} and results[1].errors == {}
    assert results[0].train_losses == pytest.approx(_reference_losses(cfg), rel=1e-4)


def test_non_finite_values_in_a_stages_own_compute_stop_it_and_its_neighbour_hears(clean):
    def setup(net, peers):
        rt = peers[1].rt
        forward = rt.forward

        def poisoned(micro, **kw):  # stage 1's weights turn NaN during step 1
            if rt.step_count == 1:
                with torch.no_grad():
                    next(rt.model.parameters()).fill_(float("nan"))
            return forward(micro, **kw)

        rt.forward = poisoned

    async def main():
        net, peers, transports = fake_swarm()
        setup(net, peers)
        return net, await asyncio.wait_for(asyncio.gather(*(p.serve(t) for p, t in zip(peers, transports)),
                                                          return_exceptions=True), 120)

    net, (r0, r1) = asyncio.run(main())
    assert isinstance(r1, NonFiniteError) and r1.step == 1 and r1.exit_code == 3, r1
    assert isinstance(r0, MaplError) and "stage 1 at mem://stage1 left before the end" in str(r0) and "non-finite" in str(r0), r0
    byes = [m.meta["reason"] for m in net.messages("stage1", "stage0") if m.type == MT.BYE]
    assert len(byes) == 1 and "non-finite values (NaN/Inf)" in byes[0]
    assert not any(m.type == MT.GRAD and m.step == 1 for m in net.messages("stage1", "stage0"))  # none sent


def test_well_formed_messages_that_do_not_fit_the_run_are_dropped_before_compute(clean):
    """A key holder sends, through its real session, tensors of the wrong shape or dtype, ids outside
    the vocabulary, NaN payloads, a NaN REPORT and an lz4 bomb (16 MiB of ids in a small frame): each
    is dropped with its SPEC §6.1 code before anything reaches the model, and training is unchanged."""
    cfg = swarm_config()
    B, T, d, r, V = (cfg.pipeline.micro_batch_size, cfg.model.context_length, cfg.model.hidden_size,
                     cfg.compression.rank, cfg.model.vocab_size)
    bf16 = lambda shape, value=0.0: torch.full(shape, value, dtype=torch.bfloat16)  # noqa: E731
    ids = torch.zeros((B, T + 1), dtype=torch.uint16)
    nan = float("nan")

    def setup(net, peers):
        down, up = peers[0].links.downstream, peers[1].links.upstream
        send_act, send_grad = down.send_act, up.send_grad
        done = set()

        async def act(step, micro, payload, *, eval_mode, pver):
            if step == 1 and "act" not in done:
                done.add("act")
                bad = [{"z": bf16((B, T, r - 1)), "ids": ids}, {"z": bf16((B, T, r)), "ids": ids[:, :-2].contiguous()},
                       {"z": bf16((B, T, r)), "ids": torch.full((B, T + 1), V, dtype=torch.uint16)},
                       {"z": bf16((B, T, r), nan), "ids": ids}, {"z": torch.zeros((B, T, r // 2)), "ids": ids},
                       {"z": bf16((B, T, r)), "ids": torch.zeros((1, 8 << 20), dtype=torch.uint16)}]
                for tensors in bad:
                    await down.send(MT.ACT, step=step, micro=micro, pver=pver, meta={"mode": "train"},
                                    tensors=tensors, kinds={k: "act" for k in tensors})
                await down.send(MT.PROJ, step=step, pver=pver, tensors={"proj": torch.full((d, r), nan)},
                                kinds={"proj": "proj"})
            await send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)

        async def grad(step, micro, payload, *, pver):
            if step == 1 and "grad" not in done:
                done.add("grad")
                await up.send(MT.GRAD, step=step, micro=micro, pver=pver, tensors={"dz": bf16((B, T, r), nan)},
                              kinds={"dz": "grad"})
                await up.send(MT.PROJ_GRAD, step=step, pver=pver, meta={"micro_batches": 2},
                              tensors={"grad": torch.zeros((d, r - 1))}, kinds={"grad": "proj_grad"})
                await up.send(MT.REPORT, step=step, meta={"mode": "train", "loss": float("nan"), "tokens": 1})
            await send_grad(step, micro, payload, pver=pver)

        down.send_act, up.send_grad = act, grad

    net, peers, results = _run(setup=setup)
    assert results[0].train_losses == clean[2][0].train_losses
    assert results[1].rejects == {"wrong_shape": 2, "id_out_of_range": 1, "non_finite": 2, "wrong_dtype": 1,
                                  "size_mismatch": 1}
    assert results[0].rejects == {"non_finite": 2, "wrong_shape": 1}


def test_a_proj_that_is_not_orthonormal_is_dropped_and_the_old_projector_kept(clean):
    """A key holder upstream sends, through its real session, its projector scaled by 2 as a re-send
    of the current version and one with a column repeated as the next version (SPEC §6.1 rule 15,
    1.5): both are dropped as ``not_orthonormal`` on the decode thread, stage 1 installs only the
    real (orthonormal) projectors, and training is unchanged."""
    from mapl_swarm.wire.content import orthonormal_error

    installed: list[tuple[int, torch.Tensor]] = []

    def setup(net, peers):
        down = peers[0].links.downstream
        send_act, send_projector = down.send_act, down.send_projector
        rt = peers[1].rt
        load = rt.load_inbound_projector
        last: dict[str, torch.Tensor] = {}
        done = set()

        async def projector(step, value, pver):
            last["proj"] = value.clone()
            await send_projector(step, value, pver)

        async def act(step, micro, payload, *, eval_mode, pver):
            if step == 1 and "proj" not in done:
                done.add("proj")
                real = last["proj"]
                repeated = real.clone()
                repeated[:, 1] = repeated[:, 0]
                for value, version in ((real * 2, pver), (repeated, pver + 1)):
                    await down.send(MT.PROJ, step=step, pver=version, tensors={"proj": value}, kinds={"proj": "proj"})
            await send_act(step, micro, payload, eval_mode=eval_mode, pver=pver)

        def record(value, version):
            installed.append((version, value.detach().clone()))
            return load(value, version)

        down.send_projector, down.send_act, rt.load_inbound_projector = projector, act, record

    net, peers, results = _run(setup=setup)
    steps = swarm_config().run.steps
    assert results[0].train_losses == clean[2][0].train_losses
    assert results[1].rejects == {"not_orthonormal": 2} and results[0].rejects == {}
    sent = [m for m in net.messages("stage0", "stage1") if m.type == MT.PROJ]
    assert len(sent) == steps + 3  # the real ones and the two forged
    assert [v for v, _ in installed] == list(range(steps + 1))  # only the real ones, in order
    assert all(orthonormal_error(a.numpy()) < 1e-5 for _, a in installed)
    inbound, outbound = peers[1].rt.inbound.projector.detach(), peers[0].rt.outbound.projector.detach()
    assert torch.equal(inbound, outbound) and peers[1].rt.inbound.version == steps


def test_run_shapes_require_an_orthonormal_projector_only_where_spel_keeps_one():
    from mapl_swarm.peer.admission import run_shapes
    assert run_shapes(swarm_config(), 1).orthonormal_projector  # mapl
    assert not run_shapes(swarm_config(compression={"codec": "naive"}), 1).orthonormal_projector


@pytest.mark.parametrize("codec", ["none", "fixed", "ssn", "naive", "mapl_vq"])
def test_every_codec_passes_the_content_checks_its_run_shapes_derive(codec):
    """What each codec's peers send fits :func:`run_shapes` of its config (nothing dropped; with
    validation, so eval ACTs and REPORTs too) and trains as one process does."""
    vq = {"vq": {"codebook_size": 16, "kmeans_iters": 2}} if codec == "mapl_vq" else {}
    cfg = swarm_config(compression={"codec": codec, **vq}, eval={"interval_steps": 2, "batches": 3})
    net, peers, results = _run(cfg)
    assert results[0].rejects == {} and results[1].rejects == {}
    assert len(results[0].train_losses) == 3 and len(results[0].val_history) == 2
    assert results[0].train_losses == pytest.approx(_reference_losses(cfg), rel=1e-4)


def test_a_three_stage_swarm_relays_and_checks_every_link():
    """A middle stage forwards ACTs and GRADs with their pver, relays REPORTs, and drops nothing."""
    cfg = swarm_config(pipeline={"num_stages": 3}, eval={"interval_steps": 3, "batches": 2})
    net, peers, results = _run(cfg)
    assert all(r.rejects == {} for r in results)
    assert results[0].train_losses == pytest.approx(_reference_losses(cfg), rel=1e-5)
    assert [m.step for m in net.messages("stage1", "stage0") if m.type == MT.REPORT] == [0, 1, 2, 3]  # 3: eval
    assert [m.meta["mode"] for m in net.messages("stage1", "stage0") if m.type == MT.REPORT][-1] == "eval"
    for a, b in (("stage1", "stage2"), ("stage0", "stage1")):
        acts = {(m.step, m.micro): m.pver for m in net.messages(a, b) if m.type == MT.ACT and m.meta["mode"] == "train"}
        assert {(m.step, m.micro): m.pver for m in net.messages(b, a) if m.type == MT.GRAD} == acts
