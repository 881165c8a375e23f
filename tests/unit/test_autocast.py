"""bf16 autocast as a tested mode on CPU (``runtime.autocast = "bf16"``): every codec trains, the
custom boundary ops keep their exact gradients, and the numbers stay within bf16 distance of fp32."""

from __future__ import annotations

import math

import pytest
import torch

from mapl_swarm.config.catalog import CODEC_NAMES
from mapl_swarm.compress.ops import project, reconstruct
from mapl_swarm.errors import ConfigError
from mapl_swarm.pipeline.inprocess import InProcessPipeline

STEPS = 3


def _losses(cfg) -> tuple[list[float], set[torch.dtype]]:
    """Losses of STEPS steps and the dtypes the first hidden layer produced."""
    torch.manual_seed(0)
    pipe = InProcessPipeline(cfg)
    seen: set[torch.dtype] = set()
    layer = pipe.stages[1].model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda mod, inp, out: seen.add(out.dtype))
    gen = torch.Generator().manual_seed(3)
    B, T = cfg.pipeline.micro_batch_size, cfg.model.context_length
    losses = [pipe.train_step([torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=gen)
                               for _ in range(cfg.pipeline.num_micro_batches)]).loss for _ in range(STEPS)]
    return losses, seen


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_every_codec_trains_under_cpu_bf16_autocast(make_config, codec):
    bf16, dtypes = _losses(make_config(compression={"codec": codec}, runtime={"autocast": "bf16"}))
    assert dtypes == {torch.bfloat16}  # the layers really ran in bf16
    fp32, dtypes32 = _losses(make_config(compression={"codec": codec}, runtime={"autocast": "off"}))
    assert dtypes32 == {torch.float32}
    assert all(math.isfinite(x) for x in bf16)
    assert bf16 == pytest.approx(fp32, rel=2e-2)  # bf16 keeps ~3 significant digits
    assert bf16 != fp32


def test_auto_is_fp32_on_cpu(make_config):
    _, dtypes = _losses(make_config(runtime={"autocast": "auto"}))
    assert dtypes == {torch.float32}


def test_autocast_choice_is_checked(make_config):
    with pytest.raises(ConfigError, match=r"runtime.autocast must be one of \('auto', 'off', 'bf16'\), got 'fp8'"):
        make_config(runtime={"autocast": "fp8"})


def test_boundary_ops_gradcheck_inside_autocast():
    r = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    a = torch.linalg.qr(torch.randn(8, 4, dtype=torch.float64))[0].requires_grad_(True)
    z = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.autograd.gradcheck(project, (r, a))
        assert torch.autograd.gradcheck(reconstruct, (z, a))


def test_bf16_activation_and_gradient_meet_the_fp32_projector():
    """The crash of every projected codec under autocast: a bf16 activation projected by the fp32
    projector, and a bf16 gradient flowing back into the op. Both directions compute in fp32 and
    equal the fp32 formulas on the bf16 values."""
    a = torch.linalg.qr(torch.randn(16, 4))[0].requires_grad_(True)
    x = torch.randn(2, 3, 16).bfloat16().requires_grad_(True)
    w = torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = project(x, a)
        y = reconstruct(z.bfloat16(), a)  # a bf16 wire payload decoded
    assert z.dtype == y.dtype == torch.float32
    (y * w).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and a.grad.dtype == torch.float32
    x32, a32 = x.detach().float().requires_grad_(True), a.detach().clone().requires_grad_(True)
    z32 = x32 @ a32
    zq = z32.detach().bfloat16().float().requires_grad_(True)
    ((zq @ a32.T) * w).sum().backward()
    z32.backward(zq.grad.bfloat16().float())  # the bf16 cast of the payload rounds its gradient too
    torch.testing.assert_close(a.grad, a32.grad)
    torch.testing.assert_close(x.grad, x32.grad.bfloat16())
