"""MAPL+VQ hot path without host syncs (issue 10 item 3), proven with a CPU proxy.

A host sync on a GPU is a read of a device tensor's values by Python (``.item()``, ``float(t)``,
``int(t)``, ``bool(t)``, ``t.tolist()``, ``t.numpy()``, ``t.cpu()``, ``t.to("cpu")``...): the
host waits for every queued kernel. On the CPU the same calls are free, so the proxy counts them:
the Tensor methods are patched and every call made while a steady-state training encode, an eval
encode, a slice apply or a decode runs is counted. The one exemption is the receiver's host-side
validation of wire inputs (``codebook_sync.host_codes_check`` / ``host_slice_check``): it reads host
memory that just came off the wire, before anything moves to the device, and the proxy checks that
every tensor it is given is a CPU tensor. The statistics are read once per step, by ``metrics()``.

Against the code before issue 10 this test fails: 5 reads per training encode (``int(dead.sum())``
per round, three ``float`` of the quantization error; its 2 CPU-drawn indices copied to the device
are the issue's other 2 on a GPU, invisible on CPU), 3 per eval encode, 1 per decode (K < 256),
1-2 per slice apply. On a GPU, ``test_vq_sizing.test_no_sync_in_cuda_encode_apply_decode`` runs
the same flow under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from mapl_swarm.compress import codebook_sync
from mapl_swarm.compress.codebook_sync import VQReceiver, VQSender, stream_generator
from mapl_swarm.compress.vq import decode_codes, to_groups
from mapl_swarm.compress.vq_stage import StageVQ
from mapl_swarm.config import CompressionConfig, VQConfig
from mapl_swarm.wire.codebook import BadCodes

_READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy")

def _compression(**kw) -> CompressionConfig:
    """A CompressionConfig from flat ``vq_*`` keywords (the [compression.vq] table's keys, prefixed)."""
    vq = {k.removeprefix("vq_"): kw.pop(k) for k in [k for k in kw if k.startswith("vq_")]}
    return CompressionConfig(**kw, vq=VQConfig(**vq))



class SyncCounter:
    """Counts host reads of tensor values (see the module docstring) while active."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._exempt = 0

    @contextlib.contextmanager
    def active(self, monkeypatch):
        with monkeypatch.context() as mp:
            for name in _READS:
                orig = getattr(torch.Tensor, name)
                mp.setattr(torch.Tensor, name, self._wrap(name, orig))
            orig_to = torch.Tensor.to

            def to(t, *args, **kw):
                dev = kw.get("device", args[0] if args else None)
                if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu" \
                        and t.device.type != "cpu":
                    self._count("to(cpu)")
                return orig_to(t, *args, **kw)

            mp.setattr(torch.Tensor, "to", to)
            for helper in ("host_codes_check", "host_slice_check"):
                if hasattr(codebook_sync, helper):
                    mp.setattr(codebook_sync, helper, self._host_only(getattr(codebook_sync, helper)))
            yield self

    def _count(self, name: str) -> None:
        if not self._exempt:
            self.calls.append(name)

    def _wrap(self, name, orig):
        def wrapper(t, *args, **kw):
            self._count(name)
            return orig(t, *args, **kw)
        return wrapper

    def _host_only(self, fn):
        """Host-side validation of wire inputs: allowed to read, but only CPU tensors."""
        def wrapper(*args, **kw):
            for a in (*args, *kw.values()):
                if isinstance(a, torch.Tensor):
                    assert a.device.type == "cpu", f"{fn.__name__} read a {a.device} tensor"
            self._exempt += 1
            try:
                return fn(*args, **kw)
            finally:
                self._exempt -= 1
        return wrapper

    def take(self) -> list[str]:
        out, self.calls = self.calls, []
        return out


def _settings(**kw) -> VQConfig:
    base = dict(codec="mapl_vq", rank=8, vq_codebook_size=32, vq_slice_fraction=0.25, vq_kmeans_iters=2,
                vq_dead_code_ratio=0.5, vq_ema_decay=0.5)  # K=32: uint8 codes below the full range
    base.update(kw)
    return _compression(**base).vq


@pytest.mark.parametrize("mode", [dict(vq_slice_order="priority"), dict(vq_slice_order="round_robin"),
                                  dict(vq_sync="full")])
def test_no_host_sync_per_encode_apply_and_decode(monkeypatch, mode):
    s = _settings(**mode)
    up = StageVQ(s, 1, has_inbound=False, has_outbound=True, seed=3)  # sender of boundary 1's act stream
    down = StageVQ(s, 2, has_inbound=True, has_outbound=False, seed=3)  # its receiver
    gen = torch.Generator().manual_seed(0)
    counter = SyncCounter()

    def batch(shift: float = 0.0) -> torch.Tensor:
        return shift + torch.randn(2, 48, 8, generator=gen)

    up.encode("act", batch(), learn=True, key=0)  # k-means initialisation: may sync (first micro-batch)
    for sl in up.take_slices("act"):
        down.apply_slice(sl)
    up.metrics()
    errors = []
    with counter.active(monkeypatch):
        for i in range(1, 9):
            z = batch(4.0 if i > 4 else 0.0)  # the distribution moves: dead codes get replaced
            codes = up.encode("act", z, learn=True, key=i)
            assert counter.take() == [], f"training encode {i}"
            slices = up.take_slices("act")
            for sl in slices:
                down.apply_slice(sl)
            assert counter.take() == [], f"slice apply {i}"
            out = down.decode("act", codes, up.version("act"))
            assert counter.take() == [], f"decode {i}"
            errors.append((z.reshape(-1, 8) - out.reshape(-1, 8)).pow(2).sum() / z.pow(2).sum())
            up.encode("act", z, learn=False)  # an eval encode (no slice, no learning)
            assert counter.take() == [], f"eval encode {i}"
        metrics = up.metrics()  # the one read of the step's statistics
    assert 0 < len(counter.take()) <= 16
    assert up.tx["act"].digest() == down.rx["act"].digest()
    # the statistics kept on the device are the ones the host used to compute per encode
    assert metrics["vq_act_dead_replaced"] > 0
    mean_err = float(torch.stack(errors).double().mean())
    assert metrics["vq_act_rel_error"] == pytest.approx(mean_err, rel=1e-5)
    assert 1.0 <= metrics["vq_act_perplexity"] <= 32.0 and metrics["vq_act_version"] == 9.0


def test_invalid_codes_are_refused_on_the_host_before_any_device_copy(monkeypatch):
    s = _settings()
    tx, rx = VQSender(s, "act", stream_generator(0, 0, "act")), VQReceiver(s, "act")
    tx.encode(torch.randn(1, 64, 8), learn=True)
    for sl in tx.take_slices():
        rx.apply(sl)
    codes = tx.encode(torch.randn(1, 16, 8), learn=False)
    moved: list[torch.Tensor] = []
    orig_to = torch.Tensor.to

    def to(t, *args, **kw):
        if t.dtype in (torch.uint8, torch.uint16):
            moved.append(t)
        return orig_to(t, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "to", to)
    bad = codes.clone()
    bad[0, 3, 1, 2] = 32  # code 32 of 32
    with pytest.raises(BadCodes):
        rx.decode(bad, tx.version)
    assert not any(m is bad for m in moved)  # refused before it was copied anywhere
    assert torch.equal(rx.decode(codes, tx.version), decode_codes(codes, tx.mirror))


def test_metrics_match_the_per_encode_definition():
    """rel_error / rel_error_round1 averaged over the encodes since the last call, as before."""
    s = _settings(vq_dead_code_ratio=0.0)
    tx = VQSender(s, "act", stream_generator(0, 0, "act"))
    gen = torch.Generator().manual_seed(1)
    tx.encode(torch.randn(1, 64, 8, generator=gen), learn=True)
    tx.metrics()
    want, want1 = [], []
    for _ in range(3):
        z = torch.randn(1, 64, 8, generator=gen)
        tx.encode(z, learn=True)
        mirror = tx.mirror.clone()  # what that encode used (its slice was applied before encoding)
        x = to_groups(z, 2)
        codes = tx.encode(z, learn=False)  # the mirror did not move: same codes as the training encode
        rec = decode_codes(codes, mirror).reshape(x.shape)
        rec1 = decode_codes(codes[..., :1, :], mirror[:1]).reshape(x.shape)
        energy = float(x.pow(2).sum())
        want += [float((x - rec).pow(2).sum()) / energy] * 2
        want1 += [float((x - rec1).pow(2).sum()) / energy] * 2
    m = tx.metrics()
    assert m["rel_error"] == pytest.approx(sum(want) / len(want), rel=1e-5)
    assert m["rel_error_round1"] == pytest.approx(sum(want1) / len(want1), rel=1e-5)
    assert m["dead_replaced"] == 0 and math.isfinite(m["perplexity"])
