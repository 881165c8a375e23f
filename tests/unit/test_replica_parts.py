"""The parts of several peers per stage (SPEC §9.10) that need no swarm: routing draws, the inbound
projector gradient kept per upstream replica, a round's checks, link sets, the handshake's replica
rule, a local swarm's replica processes, identities and summary, and ``launch --replicas``."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from mapl_swarm.cli import _replica_sets
from mapl_swarm.config import config_from_dict
from mapl_swarm.errors import ConfigError
from mapl_swarm.launch import peer_processes, replica_out_dir, summarize
from mapl_swarm.net.identity import CertificateBody, issue_local, load_identity, read_signed
from mapl_swarm.peer.link import LinkSettings, Links, PeerLink, replica_name
from mapl_swarm.peer.mailbox import Mailbox
from mapl_swarm.step.flow import act_digest as _act_digest
from mapl_swarm.step.router import Router
from mapl_swarm.pipeline.stage import StageRuntime
from mapl_swarm.replicas.gradients import ReplicaStep, round_counts
from mapl_swarm.step.rounds import commitment, read_round
from mapl_swarm.wire import Message, MessageType, WireTensor, decode, encode

CONTACTS = [f"tcp://10.0.0.{i}:5000#" + f"{i:02x}" * 32 for i in (1, 2, 3)]


def _settings(**kw) -> LinkSettings:
    base = dict(run_id="r", stage=1, num_stages=3, fingerprint="f" * 32, capabilities=("1f1b", "replicas"),
                max_frame_bytes=1 << 20, replicas=True)
    return LinkSettings(**{**base, **kw})


def _links() -> tuple[Links, list[PeerLink]]:
    links = Links(0, 2)
    made = [links.add(PeerLink(_settings(), stage, on_bad_frame=lambda *a: None, contact=c))
            for stage, c in ((0, CONTACTS[0]), (0, CONTACTS[1]), (2, CONTACTS[2]))]
    return links, made


def test_links_are_one_per_replica_named_by_contact():
    links, (a, b, c) = _links()
    assert a.name == replica_name(0, CONTACTS[0]) and a.name.startswith("stage0@") and a.name != b.name
    assert links.of_stage(0) == [a, b] and links.of_stage(2) == [c] and links.of_stage(None) == []
    assert links.stages == [0, 2] and links.stages_expected == [0, 2]
    assert links.by_contact(0, CONTACTS[1]) is b and links.by_contact(2, CONTACTS[1]) is None
    assert links.by_session("stage0.00000001") is None
    with pytest.raises(ValueError, match="linked already"):
        links.add(PeerLink(_settings(), 0, on_bad_frame=lambda *a: None, contact=CONTACTS[0]))


def test_a_mailbox_item_keeps_the_link_it_came_on():
    links, (a, b, _) = _links()
    box = Mailbox("stage1")
    box.put(Message(type=MessageType.ACT, run_id="r", src=0, dst=1, micro=1, meta={"mode": "train"}), b)
    box.put(Message(type=MessageType.ACT, run_id="r", src=0, dst=1, micro=2, meta={"mode": "train"}), a)
    msg, link = box.take_from(lambda m: m.micro == 2)
    assert (msg.micro, link) == (2, a)
    assert box.take(lambda m: True).micro == 1 and box.take_from(lambda m: True) is None


def test_a_queued_message_is_found_without_being_taken():
    links, (a, _, _) = _links()
    box = Mailbox("stage1")
    box.put(Message(type=MessageType.ROUTE, run_id="r", src=0, dst=1, step=3, meta={"phase": "reopen"}), a)
    assert box.has(lambda m: m.type is MessageType.ROUTE and m.meta["phase"] == "reopen")
    assert not box.has(lambda m: m.type is MessageType.ACT)
    assert box.waiting == 1


def test_a_re_run_is_recognised_by_its_bytes_and_versions():
    """The replica that took a micro-batch from a replica that left gives its GRAD again only for a
    re-run with the ACT it took (SPEC §9.10 item 10): same tensors and versions, same digest."""
    def act(data, *, pver=2, cver=0):
        t = WireTensor("fp16", np.asarray(data, dtype=np.float16))
        return Message(type=MessageType.ACT, run_id="r", src=1, dst=2, step=4, micro=3, pver=pver, cver=cver,
                       meta={"mode": "train"}, tensors={"x": t})

    first = _act_digest(act([1.0, 2.0, 3.0]))
    assert _act_digest(act([1.0, 2.0, 3.0])) == first
    assert _act_digest(act([1.0, 2.0, 3.5])) != first
    assert _act_digest(act([1.0, 2.0, 3.0], pver=3)) != first
    assert _act_digest(act([1.0, 2.0, 3.0], cver=1)) != first
    assert _act_digest(act([[1.0], [2.0], [3.0]])) != first  # the shape counts too


def test_a_handshake_with_replicas_needs_the_capability_and_a_contact():
    mine = _settings()
    hello = {**mine.hello_meta(CONTACTS[0]), "capabilities": ["1f1b", "replicas"]}
    assert hello["contact"] == CONTACTS[0] and mine.mismatch(hello, 0) is None
    code, why = mine.mismatch({**hello, "capabilities": ["1f1b"]}, 0)
    assert code == "fingerprint_mismatch" and "replicas.enabled mismatch: stage 0 has false, stage 1 true" in why
    code, why = mine.mismatch({k: v for k, v in hello.items() if k != "contact"}, 0)
    assert code == "fingerprint_mismatch" and "names no contact" in why
    plain = _settings(capabilities=("1f1b",), replicas=False)
    assert plain.hello_meta(CONTACTS[0])["contact"] == CONTACTS[0]  # a chain's peer names it too (SPEC §9.2)
    assert plain.mismatch({k: v for k, v in plain.hello_meta(None).items()}, 0) is None  # a 2.0 chain peer: none
    assert plain.mismatch(hello, 0)[1].endswith("stage 0 has true, stage 1 false")


def test_a_re_forming_replica_says_its_stage_s_live_replicas_and_the_stage_lost_and_its_neighbour_keeps_them():
    """SPEC §9.10 item 10: HELLO/WELCOME ``stage_replicas`` and ``lost`` of a session that re-forms
    the swarm (only then), schema-checked on decode, kept by the link its WELCOME answers."""
    assert not {"stage_replicas", "lost"} & set(_settings().hello_meta(CONTACTS[0]))
    reform = _settings(stage_replicas=2, lost=0)
    welcome = Message(type=MessageType.WELCOME, run_id="r", src=1, dst=2,
                      meta={**reform.hello_meta(CONTACTS[0]), "nonce": b"n" * 16, "hello_nonce": b"h" * 16})
    got = decode(encode(welcome))
    link = PeerLink(_settings(stage=2), 1, on_bad_frame=lambda *a: None, contact=CONTACTS[0])
    link.on_welcome(got)
    assert (link.reform_replicas, link.reform_lost) == (2, 0)


def test_routing_draws_are_a_function_of_the_micro_batch_and_follow_throughput():
    _, (a, b, _) = _links()
    links = [a.name, b.name]
    uniform = Router(routing="uniform", seed=3, stage=0)
    picks = [uniform.pick(links, 5, m) for m in range(400)]
    assert picks == [Router(routing="uniform", seed=3, stage=0).pick(links, 5, m) for m in range(400)]
    assert 150 < Counter(picks)[a.name] < 250  # about half
    assert picks != [Router(routing="uniform", seed=4, stage=0).pick(links, 5, m) for m in range(400)]
    fast = Router(routing="throughput", seed=3, stage=0)
    fast.mean_s = {a.name: 0.1, b.name: 1.0}  # a answers 10x faster
    share = Counter(fast.pick(links, 1, m) for m in range(400))[a.name] / 400
    assert share == pytest.approx(10 / 11, abs=0.06)
    fast.in_flight[a.name] = 9  # ...but holds 9 micro-batches already: now both weigh alike
    assert Counter(fast.pick(links, 1, m) for m in range(400))[a.name] / 400 == pytest.approx(0.5, abs=0.1)
    fast.returned(a.name, 0.3)
    assert fast.in_flight[a.name] == 8 and fast.mean_s[a.name] == pytest.approx(0.7 * 0.1 + 0.3 * 0.3)


def test_the_inbound_projector_gradient_is_kept_apart_per_upstream_replica(make_config):
    cfg = make_config(pipeline={"num_stages": 2, "micro_batch_size": 2, "num_micro_batches": 3},
                      compression={"codec": "mapl"})
    sender, split, whole = StageRuntime(cfg, 0), StageRuntime(cfg, 1), StageRuntime(cfg, 1)
    gen = torch.Generator().manual_seed(0)
    for micro, origin in enumerate(["a", "b", "a"]):
        payload = sender.forward(micro, ids=torch.randint(0, 256, (2, 17), generator=gen)).payload
        for rt, key in ((split, origin), (whole, None)):
            rt.forward(micro, payload=payload)
            rt.backward(micro, **({"origin": key} if key else {}))
    a, b = split.take_inbound_projector_grad("a"), split.take_inbound_projector_grad("b")
    torch.testing.assert_close(a + b, whole.take_inbound_projector_grad(), rtol=1e-5, atol=1e-7)
    assert not torch.equal(a, torch.zeros_like(a)) and not torch.equal(b, torch.zeros_like(b))
    assert torch.equal(split.take_inbound_projector_grad(), torch.zeros_like(a))  # nothing left unsplit
    split.step()  # every origin's part taken: the step may go on
    split.forward(0, payload=payload)
    split.backward(0, origin="a")
    with pytest.raises(RuntimeError, match="1 upstream replicas' projector gradients not taken"):
        split.step()


def test_a_round_is_whole_when_every_micro_batch_is_counted_once_in_one_epoch_with_equal_digests():
    def round_(micro: dict, digests: dict | None = None, epochs: dict | None = None) -> ReplicaStep:
        return ReplicaStep("p2", ("p1", "p2"), digests or {"p1": "d", "p2": "d"}, micro, 7.5,
                           epochs=epochs or {"p1": 0, "p2": 0})

    ok = round_({"p1": (0, 2), "p2": (1,)})
    assert ok.problem(3) is None and ok.rank == 1 and ok.group_size == 2 and ok.in_sync
    assert ok.counts == {"p1": 2, "p2": 1}
    assert "1 missing, 0 counted twice" in round_({"p1": (0, 1), "p2": ()}).problem(3)
    # the counts add up, but micro-batch 1 is in both (a re-route after a replica left) and 2 in none
    assert "1 missing, 1 counted twice" in round_({"p1": (0, 1), "p2": (1,)}).problem(3)
    assert "out of range" in round_({"p1": (0, 1), "p2": (3,)}).problem(3)
    assert "different parameters" in round_({"p1": (0, 1), "p2": (2,)}, digests={"p1": "d", "p2": "e"}).problem(3)
    assert "different epochs" in round_({"p1": (0, 1), "p2": (2,)}, epochs={"p1": 0, "p2": 1}).problem(3)


def test_the_stages_digest_is_the_one_most_replicas_hold_and_a_tie_is_drawn_in_the_next_round():
    def round_(digests: dict, behind: frozenset = frozenset(), **kw) -> ReplicaStep:
        return ReplicaStep("p1", tuple(sorted(digests)), digests, {p: () for p in digests}, 0.0, behind=behind, **kw)

    assert round_({"p1": "x", "p2": "d", "p3": "d"}).reference() == "d"  # the majority, wherever it sorts
    assert round_({"p1": "x", "p2": "d"}).reference() is None  # a tie: nobody's word (nor key) decides it now
    assert round_({"a": "e", "b": "d", "c": "d", "d": "e", "e": "f"}).tied == ["d", "e"]
    # a replica that resumed behind its stage (SPEC §9.10 item 13) never holds the stage's digest
    assert round_({"p1": "x", "p2": "d"}, frozenset({"p1"})).reference() == "d"
    assert round_({"p1": "x", "p2": "y", "p3": "y"}, frozenset({"p2", "p3"})).reference() == "x"
    assert round_({"p1": "x", "p2": "d"}, frozenset({"p1", "p2"})).reference() is None  # all behind: as without
    gathered = {"digest": "x", "micro": [], "loss": 0.0, "epoch": 0, "contact": "c", "step": -1, "expected": 2}
    assert read_round("p1", {"p1": {**gathered, "behind": True}, "p2": {**gathered, "behind": 1}}).behind == {"p1"}
    n1, n2 = bytes(32), bytes([7]) * 32
    got = read_round("p1", {"p1": {**gathered, "commit": commitment(n1), "reveal": n2.hex()},
                            "p2": {**gathered, "commit": 5, "reveal": "zz" * 32}})
    assert got.commits == {"p1": commitment(n1)} and got.reveals == {"p1": n2}  # malformed ones are none


def test_a_tie_of_digests_is_won_by_the_draw_not_by_a_chosen_key_or_digest():
    """Two replicas hold different parameters: the next round's revealed nonces, committed to in the
    tied round, decide; each holder wins about half the draws whatever its peer id; a member that
    reveals no nonce of its commitment, or no longer holds its digest, cannot win."""
    rng = random.Random(3)

    def draw(ids: tuple[str, str], *, reveal_b: bool = True, b_now: str = "b") -> str | None:
        a, b = ids
        nonces = {a: rng.randbytes(32), b: rng.randbytes(32)}
        digests = {a: "A", b: "B"}
        tied = ReplicaStep(a, tuple(sorted(ids)), digests, {a: (), b: ()}, 0.0,
                           commits={p: commitment(n) for p, n in nonces.items()})
        reveals = {a: nonces[a], b: nonces[b] if reveal_b else rng.randbytes(32)}
        nxt = ReplicaStep(a, tuple(sorted(ids)), {a: "A", b: "B" if b_now == "b" else "C"}, {a: (), b: ()}, 0.0,
                          reveals=reveals)
        assert tied.reference() is None
        return nxt.reference(tied)

    for ids in (("p1", "p2"), ("p2", "p1"), ("00000000ground", "zzz")):
        wins = Counter(draw(ids) for _ in range(400))
        assert set(wins) == {"A", "B"} and 140 < wins["B"] < 260, (ids, wins)
    assert {draw(("p1", "p2"), reveal_b=False) for _ in range(50)} == {"A"}  # a broken reveal forfeits
    assert {draw(("p1", "p2"), b_now="c") for _ in range(50)} == {"A"}  # its digest changed since: not a candidate
    other = ReplicaStep("p1", ("p1", "p2", "p3"), {"p1": "A", "p2": "B", "p3": "B"}, {}, 0.0)
    assert other.reference(ReplicaStep("p1", ("p1", "p2"), {"p1": "A", "p2": "B"}, {}, 0.0)) == "B"  # a majority now


def test_only_a_round_that_makes_the_step_runs_its_all_reduce():
    """What the averager asks before it sends a tensor byte (``round_counts`` on what every member
    gathered): a round that cannot count (a replica left with micro-batches of the step, a member
    of another step or epoch, fewer members than expected, different digests, data of another
    form) runs no all-reduce, so it does not load the links the redo then travels on."""
    def gathered(micro, *, digest="d", epoch=0, step=4, expected=2, **extra):
        return {"digest": digest, "micro": list(micro), "loss": 0.5, "epoch": epoch, "contact": "c", "step": step,
                "expected": expected, **extra}

    assert round_counts(3, {"p1": gathered([0, 2]), "p2": gathered([1])})
    assert not round_counts(3, {"p1": gathered([0, 2]), "p2": gathered([])})  # micro-batch 1 died with a replica
    assert not round_counts(3, {"p1": gathered([0, 1]), "p2": gathered([1, 2])})  # 1 counted twice
    assert not round_counts(3, {"p1": gathered([0, 2]), "p2": gathered([1], epoch=1)})
    assert not round_counts(3, {"p1": gathered([0, 2]), "p2": gathered([1], step=5)})
    assert not round_counts(3, {"p1": gathered([0, 2]), "p2": gathered([1], digest="e")})
    assert not round_counts(3, {"p1": gathered([0, 1, 2], expected=2)})  # the partner is not in it
    assert not round_counts(3, {"p1": gathered([0, 2]), "p2": {"micro": "all"}})
    assert not round_counts(3, {})


def test_replicas_are_configured_per_stage_and_with_codebooks_learned_per_step():
    cfg = config_from_dict({"pipeline": {"num_stages": 3}, "replicas": {"enabled": True, "initial": [1, 2, 2]}})
    assert [cfg.replicas_of(s) for s in range(3)] == [1, 2, 2]
    for bad, match in (({"enabled": True, "initial": [2, 2]}, "lists 2 stage"),
                       ({"initial": [1, 2, 1]}, "set replicas.enabled = true"),
                       ({"enabled": True, "initial": [0, 1, 1]}, "positive replica counts")):
        with pytest.raises(ConfigError, match=match):
            config_from_dict({"pipeline": {"num_stages": 3}, "replicas": bad})
    with pytest.raises(ConfigError, match="needs compression.vq.update = 'step'"):
        config_from_dict({"compression": {"codec": "mapl_vq"}, "replicas": {"enabled": True}})
    vq = config_from_dict({"compression": {"codec": "mapl_vq", "vq": {"update": "step"}}, "replicas": {"enabled": True}})
    assert vq.compression.vq.update == "step"
    with pytest.raises(ConfigError, match="num_stages >= 2"):
        config_from_dict({"pipeline": {"num_stages": 1}, "replicas": {"enabled": True}})
    assert _replica_sets("2", 3) == ["replicas.enabled=true", "replicas.initial=[2, 2, 2]"]
    assert _replica_sets("1,2,2", 3)[1] == "replicas.initial=[1, 2, 2]"
    for bad in ("two", "0", "1,-1"):
        with pytest.raises(ConfigError, match="--replicas"):
            _replica_sets(bad, 3)


def test_a_local_swarm_starts_every_replica_with_its_own_identity_folder_and_ports(tmp_path):
    local = issue_local(tmp_path / "ids", run_id="r", num_stages=2, replicas=[1, 2])
    ids = {(s, r): load_identity(local.key_file(s, r), local.cert_file(s, r), run_id="r", stage=s)
           for s, r in ((0, 0), (1, 0), (1, 1))}
    assert len({i.key.sign_public for i in ids.values()}) == 3  # a key of its own each
    body = CertificateBody.decode(read_signed(local.cert_file(1, 1), "certificate").body)
    assert body.stages == (1,) and body.name == "stage1r1"
    layout = [(0, 0), (1, 0), (1, 1)]
    procs = peer_processes(2, ["--config", "c.toml"], maddr="m", threads=1, progress=True, gpus=[None, "0", "1"],
                           environ={}, member_args=[local.args(s, r) for s, r in layout], net_port=7000,
                           replicas=[1, 2], out_dir=tmp_path / "run")
    assert [(p.stage, p.replica, p.label) for p in procs] == [(0, 0, "stage 0"), (1, 0, "stage 1"),
                                                              (1, 1, "stage 1 replica 1")]
    assert [p.env.get("CUDA_VISIBLE_DEVICES") for p in procs] == [None, "0", "1"]
    assert [next(a for a in p.cmd if a.startswith("net.port=")) for p in procs] == [
        "net.port=7000", "net.port=7001", "net.port=7002"]
    assert f'run.out_dir={json.dumps(str(tmp_path / "run" / "replica1"))}' in procs[2].cmd
    assert not any(a.startswith("run.out_dir=") for p in procs[:2] for a in p.cmd)
    assert str(local.key_file(1, 1)) in procs[2].cmd and "--quiet" not in procs[0].cmd and "--quiet" in procs[2].cmd


def test_the_summary_adds_every_replicas_bytes_per_boundary(tmp_path):
    def result(stage: int, links: dict) -> dict:
        return {"train_losses": [1.0], "report_times_s": [1.0], "val_history": [], "tokens": 100, "wall_s": 2.0,
                "payload_tx": links, "wire_tx": {k: {"ACT": 10} for k in links}, "shaper": {}}

    files = {(0, 0): {**result(0, {"stage1@aa": {"act": 300, "ids": 100}, "stage1@bb": {"act": 100}}),
                      "averaging": {"rounds": 1, "sent_bytes": 40, "received_bytes": 40}},
             (0, 1): result(0, {"stage1@aa": {"act": 200}}),
             (1, 0): result(1, {"stage0@cc": {"grad": 150}, "stage0@dd": {"grad": 50}}),
             (1, 1): result(1, {"stage0@cc": {"grad": 100}})}
    for (s, r), res in files.items():
        replica_out_dir(tmp_path, r).mkdir(parents=True, exist_ok=True)
        (replica_out_dir(tmp_path, r) / f"peer_stage{s}.json").write_text(json.dumps(res))
    summary = summarize(tmp_path, 2, [2, 2])
    (link,) = summary.links
    assert link["forward_payload"] == pytest.approx((300 + 100 + 100 + 200) / 100)
    assert link["backward_payload"] == pytest.approx((150 + 50 + 100) / 100)
    assert link["forward_wire"] == pytest.approx(30 / 100)
    # one step (one loss), 40 averaging bytes against 6 links x 10 wire bytes
    assert summary.averaging == {"bytes_per_step": 40.0, "share": pytest.approx(40 / 100)}


def test_a_sync_round_of_fewer_than_the_starting_replicas_is_refused_by_every_member():
    """Three replicas start a stage; hivemind forms a group of 2 once its matchmaking time passed
    (a third started a moment late): each member of that group gathered the 3 it expects, so every
    one refuses the round and tries again, instead of training as "replica x of 2" while the third
    averages alone for good (seen with a replica started a second after its partners)."""
    from types import SimpleNamespace

    from mapl_swarm.replicas.gradients import AveragingFailed, ReplicaGradients

    grads = object.__new__(ReplicaGradients)
    grads.me = "p1"
    grads.runtime = SimpleNamespace(stage=1, modules=torch.nn.Linear(2, 2), codec=SimpleNamespace(
        replicated_state=lambda: {}))
    grads.averager = SimpleNamespace(set_group_size=lambda n: None)
    grads._nonce, grads._revealed = bytes(32), None
    grads.checker, grads._checked = None, None
    seen, commits = [], []

    def gathered(weight, gather, timeout):
        seen.append(gather["expected"])
        commits.append((gather["commit"], gather.get("reveal")))
        return {"p1": gather, "p2": {**gather, "contact": "other"}}, 0, 0

    grads._gathered = gathered
    with pytest.raises(AveragingFailed, match="a sync round of 2 of the 3 replicas that start together"):
        grads.sync(timeout=5.0, contact="mine", expected=3)
    assert seen == [3]
    assert grads.sync(timeout=5.0, contact="mine", expected=2).group_size == 2
    # a refused round keeps its commitment; one that went to the core is revealed in the next
    grads.sync(timeout=5.0, contact="mine", expected=2)
    assert commits[0] == commits[1] == (commitment(bytes(32)), None)
    assert commits[2][1] == bytes(32).hex() and commits[2][0] != commits[1][0]


def test_replicas_on_other_kernels_hold_close_parameters_and_their_round_is_whole():
    """Two CPU instruction sets step AdamW to other last bits (ATEN_CPU_CAPABILITY default against
    AVX2, measured), so replicas on mixed hardware hold other digests after every step: their round
    is whole when the frames are equal and the sketches within SKETCH_TOLERANCE (SPEC §9.10 item 6);
    a real divergence, another frame or a malformed sketch is not close."""
    from mapl_swarm.replicas.state import state_summary
    from mapl_swarm.step.rounds import SKETCH_TOLERANCE

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ulp = {k: v * (1 + torch.randn_like(v) * 6e-8) for k, v in state.items()}  # last-bit differences
    drifted = {k: v + 1e-3 * torch.randn_like(v) for k, v in state.items()}  # another state
    cast = {k: v.to(torch.float64) for k, v in state.items()}  # another frame

    def gathered(s: dict) -> dict:
        digest, frame, sketch = state_summary(s)
        return {"digest": digest, "frame": frame, "sketch": sketch, "micro": [0], "loss": 0.0, "epoch": 0,
                "contact": "c", "step": 3, "expected": 2}

    def round_(a: dict, b: dict) -> ReplicaStep:
        got = read_round("p1", {"p1": a, "p2": {**b, "micro": [1]}})
        assert got is not None
        return got

    base = gathered(state)
    near = round_(base, gathered(ulp))
    assert not near.in_sync and near.close and near.agrees and near.problem(2) is None
    assert round_counts(2, {"p1": base, "p2": {**gathered(ulp), "micro": [1]}})  # its all-reduce runs
    far = round_(base, gathered(drifted))
    assert not far.close and "different parameters" in far.problem(2)
    assert not round_(base, gathered(cast)).close
    assert not round_(base, {**gathered(ulp), "sketch": [1.0, float("nan")]}).close
    assert not round_(base, {k: v for k, v in gathered(ulp).items() if k != "sketch"}).close
    assert SKETCH_TOLERANCE < 1e-3
