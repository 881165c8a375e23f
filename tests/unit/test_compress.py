"""Boundary codecs: exact backward, anchors, byte accounting, SSN losslessness."""

import pytest
import torch

from mapl_swarm.compress import Boundary, StageAnchor, boundary_bytes
from mapl_swarm.compress.codecs import boundary_projector
from mapl_swarm.compress.ops import project, reconstruct
from mapl_swarm.optim import stiefel_error
from mapl_swarm.pipeline.inprocess import InProcessPipeline


def test_project_reconstruct_gradcheck_float64():
    torch.manual_seed(0)
    r = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    a = torch.linalg.qr(torch.randn(8, 4, dtype=torch.float64))[0].requires_grad_(True)
    z = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(project, (r, a))
    assert torch.autograd.gradcheck(reconstruct, (z, a))


def test_mapl_boundary_split_backward_matches_formula_autograd():
    """Sender grad (R^T dZ) + receiver grad (dX^T Z) == d/dA of the fused formula, and the
    gradient reaching X equals autograd of X_hat = ((X - a_s) A) A^T + a_r."""
    torch.manual_seed(1)
    d, r = 16, 4
    send = Boundary("send", 0, boundary_projector(d, r, seed=0, index=0), trainable=True).double()
    recv = Boundary("recv", 0, boundary_projector(d, r, seed=0, index=0), trainable=True).double()
    torch.testing.assert_close(send.projector, recv.projector, rtol=0, atol=0)
    x = torch.randn(2, 5, d, dtype=torch.float64, requires_grad=True)
    a_send, a_recv = torch.randn(2, 5, d, dtype=torch.float64), torch.randn(2, 5, d, dtype=torch.float64)
    w = torch.randn(2, 5, d, dtype=torch.float64)  # downstream loss weights
    # split: sender -> "wire" -> receiver
    z = send.encode(x, a_send)
    z_in = z.detach().requires_grad_(True)
    (recv.decode(z_in, a_recv) * w).sum().backward()
    z.backward(z_in.grad)
    split_grad_a = send.projector.grad + recv.projector.grad
    # fused reference with plain autograd
    x2 = x.detach().clone().requires_grad_(True)
    a = send.projector.detach().clone().requires_grad_(True)
    ((((x2 - a_send) @ a) @ a.T + a_recv) * w).sum().backward()
    torch.testing.assert_close(split_grad_a, a.grad)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(z_in.grad, (w @ a).detach())  # dL/dZ = dL/dX_hat @ A


def test_projector_is_on_stiefel_and_seeded_by_boundary():
    b0 = Boundary("send", 0, boundary_projector(64, 16, seed=5, index=0), trainable=True)
    b1 = Boundary("send", 1, boundary_projector(64, 16, seed=5, index=1), trainable=True)
    assert stiefel_error(b0.projector.detach()) < 1e-5
    assert not torch.equal(b0.projector, b1.projector)


@pytest.mark.parametrize("kind", ["factorized", "full", "static", "none"])
def test_anchor_kinds(kind):
    anchor = StageAnchor(kind, vocab_size=50, hidden_size=32, rank=8, init_std=0.02, seed=0, stage=1)
    ids = torch.tensor([[1, 2, 3]])
    out = anchor(ids)
    if kind == "none":
        assert out is None
        return
    assert out.shape == (1, 3, 32)
    trainable = [p for p in anchor.parameters() if p.requires_grad]
    assert len(trainable) == (0 if kind == "static" else 1)
    if kind == "factorized":
        basis = anchor.basis
        torch.testing.assert_close(basis @ basis.T, torch.eye(8), atol=1e-5, rtol=0)
        assert anchor.table.shape == (50, 8)


def test_bytes_accounting_formula():
    b = boundary_bytes("mapl", 256, 64, "bf16", 8192, seq_len=256)
    assert b.forward_act_bytes == 128 and b.backward_bytes == 128
    assert b.forward_ids_bytes == pytest.approx(2 * 257 / 256)
    n = boundary_bytes("none", 256, 64, "bf16", 8192, seq_len=256)
    assert n.forward_act_bytes == 512 and n.backward_bytes == 512
    assert boundary_bytes("none", 256, 64, "fp32", 70000, seq_len=4).forward_ids_bytes == 4 * 5 / 4
    # a trainable projector's exchange, amortised over the step: d x r fp32 each way
    assert b.projector_bytes == 0.0  # no tokens per step given
    assert boundary_bytes("mapl", 256, 64, "bf16", 8192, seq_len=256, tokens_per_step=4096).projector_bytes == 16.0
    assert boundary_bytes("fixed", 256, 64, "bf16", 8192, seq_len=256, tokens_per_step=4096).projector_bytes == 0.0


@pytest.mark.parametrize("codec,wire", [("mapl", "bf16"), ("none", "bf16"), ("ssn", "fp32"), ("fixed", "fp16")])
def test_measured_link_bytes_equal_accounting(make_config, codec, wire):
    cfg = make_config(compression={"codec": codec, "wire_dtype": wire})
    pipe = InProcessPipeline(cfg)
    gen = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(2)]
    _, tokens = pipe.accumulate(mbs)
    exp = boundary_bytes(codec, 64, 16, wire, 256, 16)
    for link in pipe.links:
        assert link.bytes["act"] == exp.forward_act_bytes * tokens
        assert link.bytes["ids"] == exp.forward_ids_bytes * tokens
        assert link.bytes["grad"] == exp.backward_bytes * tokens
    pipe.finish_step()
    d, r = 64, 16
    for link in pipe.links:  # one fp32 projector each way per step for learned projectors only
        expected = d * r * 4 if codec == "mapl" else 0
        assert link.bytes["proj"] == expected and link.bytes["proj_grad"] == expected


def test_ssn_boundary_is_lossless_at_every_boundary(make_config):
    cfg = make_config(compression={"codec": "ssn", "wire_dtype": "fp32", "ssn_refresh_interval_steps": 2},
                      pipeline={"num_stages": 4}, run={"steps": 10})
    pipe = InProcessPipeline(cfg)
    captured = []
    for stage in pipe.stages[:-1]:
        encode = stage.outbound.encode

        def spy(x, offset, encode=encode, stage=stage):
            z = encode(x, offset)
            captured.append((stage.stage, (x - offset).detach(), z.detach(), stage.codec.basis.detach().clone()))
            return z
        stage.outbound.encode = spy
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # includes a Grassmann refresh of U at step 2
        pipe.train_step([torch.randint(0, 256, (2, 17), generator=gen) for _ in range(2)])
    assert len(captured) == 3 * 2 * 3
    for _, resid, z, basis in captured:
        recon = z @ basis.T
        assert torch.linalg.vector_norm(recon - resid) / torch.linalg.vector_norm(resid) < 1e-5
    bases = [s.codec.basis.detach() for s in pipe.stages]
    assert all(torch.equal(bases[0], b) for b in bases[1:])
    assert stiefel_error(bases[0]) < 1e-4
