"""MAPL+VQ with ``compression.vq.update = step``: codebooks that learn once per step from the step's
statistics, so that replicas of a stage, each encoding some of the step's micro-batches, hold the
same codebooks after averaging those statistics (SPEC §9.10 item 3)."""

import torch

from mapl_swarm.compress.codebook_sync import VQReceiver, VQSender, stream_generator
from mapl_swarm.config import CompressionConfig, VQConfig
from mapl_swarm.pipeline.inprocess import InProcessPipeline
from mapl_swarm.wire.codebook import StaleSlice

M = 4
"""Micro-batches per step in these tests."""


def _settings(**kw) -> VQConfig:
    vq = dict(codebook_size=16, kmeans_iters=4, update="step")
    vq.update(kw)
    return CompressionConfig(codec="mapl_vq", rank=8, vq=VQConfig(**vq)).vq


def _sender(s: VQConfig) -> VQSender:
    return VQSender(s, "act", stream_generator(0, 0, "act"), micro_batches=M)


def _steps(gen: torch.Generator, steps: int) -> list[list[torch.Tensor]]:
    centers = torch.randn(6, 8, generator=gen) * 2
    out = []
    for _ in range(steps):
        step = []
        for _ in range(M):
            pick = torch.randint(0, 6, (40,), generator=gen)
            step.append((centers[pick] + 0.2 * torch.randn(40, 8, generator=gen)).unsqueeze(0))
        out.append(step)
    return out


def _average(parts: list[tuple[list[torch.Tensor], int]]) -> list[torch.Tensor]:
    """What a stage's averaging round gives: each sender's shares pre-scaled by M / n, averaged
    with weight n (as :class:`~mapl_swarm.replicas.gradients.ReplicaGradients` does)."""
    total = sum(n for _, n in parts)
    out = [torch.zeros_like(t) for t in parts[0][0]]
    for tensors, n in parts:
        for o, t in zip(out, tensors):
            if n:
                o.add_(t * (M / n), alpha=n / total)
    return out


def test_codebooks_change_only_at_the_step_end_and_replicas_agree_after_averaging():
    s = _settings()
    one = _sender(s)
    a, b = _sender(s), _sender(s)
    rx = VQReceiver(s, "act")
    errors = []
    for step, batch in enumerate(_steps(torch.Generator().manual_seed(0), 4)):
        mirror = one.mirror.clone()
        codes = [one.encode(z, learn=True, first=i == 0) for i, z in enumerate(batch)]
        assert one.take_slices() == [] and torch.equal(one.mirror, mirror)  # nothing moves within the step
        # two replicas: a encodes micro-batches 0 and 2, b the others; both encode with the same codebooks
        for i, z in enumerate(batch):
            tx = a if i % 2 == 0 else b
            assert torch.equal(tx.encode(z, learn=True, first=i == 0), codes[i])
        avg = _average([(a.step_statistics(), 2), (b.step_statistics(), 2)])
        for tx in (a, b):
            for t, v in zip(tx.step_statistics(), avg):
                t.copy_(v)
        errors.append(one.metrics()["rel_error"])
        one.end_step()
        a.end_step()
        b.end_step()
        assert one.version == a.version == b.version == step + 1
        assert a.digest() == b.digest()  # the replicas hold the same bytes
        torch.testing.assert_close(a.mirror, one.mirror, rtol=1e-5, atol=1e-6)  # = one sender with the whole step
        (sl,) = [one.full_slice()]
        assert sl.full and sl.version == step + 1
        assert rx.apply(sl) == "apply" and rx.digest() == one.digest()
    assert one.init_done == 1 and bool(one.mirror.abs().sum() > 0)
    assert errors[0] == 1.0 and errors[-1] < 0.1  # step 0: zero codebooks; then they fit the mixture


def test_first_step_encodes_with_zero_codebooks_then_kmeans_of_its_first_micro_batch():
    s = _settings(dead_code_ratio=0.0)
    tx = _sender(s)
    first, *rest = _steps(torch.Generator().manual_seed(1), 1)[0]
    assert int(tx.encode(first, learn=True, first=True).max()) == 0  # version 0: all-zero codebooks
    for z in rest:
        tx.encode(z, learn=True)
    tx.end_step()
    assert tx.version == 1 and tx.init_done == 1
    tx.metrics()
    tx.encode(first, learn=False)
    assert tx.metrics()["rel_error"] < 0.05  # k-means of that very micro-batch


def test_a_step_redone_forgets_its_statistics():
    s = _settings()
    tx, ref = _sender(s), _sender(s)
    data = _steps(torch.Generator().manual_seed(2), 2)
    for batch in data:
        for i, z in enumerate(batch):
            ref.encode(z, learn=True, first=i == 0)
        ref.end_step()
    for i, z in enumerate(data[0]):
        tx.encode(z, learn=True, first=i == 0)
    tx.end_step()
    for i, z in enumerate(data[1][:2]):  # half the step, then it is redone
        tx.encode(z, learn=True, first=i == 0)
    tx.clear_step()
    for i, z in enumerate(data[1]):
        tx.encode(z, learn=True, first=i == 0)
    tx.end_step()
    assert tx.digest() == ref.digest()


def test_receiver_ignores_another_replicas_copy_of_its_version_and_refuses_a_different_one():
    s = _settings()
    tx = _sender(s)
    for i, z in enumerate(_steps(torch.Generator().manual_seed(3), 1)[0]):
        tx.encode(z, learn=True, first=i == 0)
    tx.end_step()
    rx = VQReceiver(s, "act")
    assert rx.apply(tx.full_slice()) == "apply"
    assert rx.apply(tx.full_slice()) == "ignore" and rx.ignored == 1  # the same slice from another replica
    forged = tx.full_slice()
    forged.codes[0, 0, 0, 0] += 1.0
    try:
        rx.apply(forged)
        raise AssertionError("a different slice at the receiver's version was applied")
    except StaleSlice:
        pass
    assert rx.digest() == tx.digest()


def test_in_process_pipeline_sends_one_full_slice_per_step_and_link(make_config):
    cfg = make_config(compression={"codec": "mapl_vq", "vq": {"codebook_size": 16, "update": "step"}},
                      pipeline={"num_micro_batches": 3})
    pipe = InProcessPipeline(cfg)
    gen = torch.Generator().manual_seed(0)
    steps = 3
    losses = [pipe.train_step([torch.randint(0, 256, (2, 17), generator=gen) for _ in range(3)]).loss
              for _ in range(steps)]
    assert all(torch.isfinite(torch.tensor(losses)))
    s = pipe.stages[0].vq.s
    for b, link in enumerate(pipe.links):
        a, c = pipe.stages[b].vq, pipe.stages[b + 1].vq
        # a version per step from the step after the stream's first non-zero micro-batch 0 (a grad
        # stream upstream of a stage whose own grad codes decoded to zero starts a step later);
        # one full slice per version, before the first payload that needs it
        for tx, rx, stream, kind in ((a, c, "act", "codebook"), (c, a, "grad", "grad_codebook")):
            assert 1 <= tx.tx[stream].version <= steps
            assert rx.rx[stream].version == tx.tx[stream].version - 1  # the last one goes with the next payload
            assert link.bytes[kind] == rx.rx[stream].version * s.slice_bytes(16)
            (sl,) = tx.slices_for(stream, rx.rx[stream].version)
            assert rx.apply_slice(sl) == "apply" and tx.slices_for(stream, rx.rx[stream].version) == []
            assert tx.tx[stream].digest() == rx.rx[stream].digest()
    assert pipe.stages[0].vq.tx["act"].version == steps  # stage 0's Z is never zero
