"""SPEC §6.1 rule 15 (1.5; rule 14 before 2.1): a PROJ whose projector is not orthonormal is dropped as ``not_orthonormal``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mapl_swarm.wire import Message, MessageType, WireTensor, decode, encode
from mapl_swarm.wire.content import CONTENT_CODES, ContentError, RunShapes, check_content, orthonormal_error
from mapl_swarm.wire.golden.content_cases import RUN, STIEFEL, UNCONSTRAINED_RUN, WINDOW
from mapl_swarm.wire.spec import PROJ_ORTHONORMAL_TOL

MT = MessageType
TOL = PROJ_ORTHONORMAL_TOL


def proj(a: np.ndarray, *, pver: int = 13) -> Message:
    """PROJ version ``pver`` (the link is at 12) from upstream, carrying ``a`` as fp32."""
    return Message(type=MT.PROJ, run_id="r", src=0, dst=1, step=13, pver=pver,
                   tensors={"proj": WireTensor("fp32", np.ascontiguousarray(a, dtype="<f4"))})


def shapes_for(a: np.ndarray, run: RunShapes = RUN) -> RunShapes:
    return replace(run, hidden_size=a.shape[0], width=a.shape[1])


def outcome(a: np.ndarray, run: RunShapes = RUN) -> str:
    """``accept`` or the code, after a trip through the wire (what a receiver decodes)."""
    shapes = shapes_for(a, run)
    msg = decode(encode(proj(a)), limits=shapes.decode_limits())
    try:
        check_content(msg, shapes, WINDOW)
    except ContentError as e:
        assert e.code in CONTENT_CODES
        return e.code
    return "accept"


def haar(d: int, r: int, seed: int) -> np.ndarray:
    """A random (d, r) with orthonormal columns: QR of a Gaussian in fp64, rounded to fp32."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, r)))
    return q.astype("<f4")


def bf16_round(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (nearest, ties to even) and back to fp32."""
    bits = np.asarray(a, "<f4").view("<u4").astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype("<u4").view("<f4")


# ---------------------------------------------------------------------- accepted
@pytest.mark.parametrize("d, r", [(8, 4), (64, 16), (256, 64), (1024, 256)])
def test_an_orthonormal_fp32_projector_is_accepted(d, r):
    a = haar(d, r, seed=d + r)
    assert orthonormal_error(a) < 1e-5  # the fp32 rounding floor, far below the tolerance
    assert outcome(a) == "accept"


def test_the_golden_projector_is_exactly_orthonormal():
    assert STIEFEL.dtype == np.float32 and STIEFEL.shape == (RUN.hidden_size, RUN.width)
    assert orthonormal_error(STIEFEL) == 0.0
    assert np.count_nonzero(STIEFEL) == STIEFEL.size  # dense, not a padded identity
    assert outcome(STIEFEL) == "accept"


def test_a_square_orthogonal_projector_is_accepted():
    assert outcome(haar(16, 16, seed=3)) == "accept"  # r = d (an uncompressed-width projector)


def test_just_inside_the_tolerance_is_accepted():
    a = haar(64, 16, seed=1).astype(np.float64)
    a[:, 0] *= 1 + 4e-4  # ‖AᵀA − I‖_F = 2ε + ε² ≈ 8e-4
    assert 7e-4 < orthonormal_error(a.astype("<f4")) < TOL
    assert outcome(a) == "accept"


def test_a_spel_updated_projector_is_accepted():
    """The reference sender's own projectors: random_stiefel, then SPEL steps, as a PROJ on the wire."""
    torch = pytest.importorskip("torch")
    from mapl_swarm.compress.stiefel import random_stiefel
    from mapl_swarm.optim.spel import SPEL, stiefel_error

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(random_stiefel(256, 64, g))
    assert outcome(p.detach().numpy()) == "accept"  # the initial projector (pver 0 in a run)
    opt = SPEL([p], lr=0.02)
    start = p.detach().clone()
    for _ in range(20):
        p.grad = torch.randn(256, 64, generator=g)
        opt.step()
    a = p.detach().numpy()
    assert float((p.detach() - start).norm()) > 0.1  # it moved
    assert stiefel_error(p) == pytest.approx(orthonormal_error(a), rel=1e-9)  # one measure
    assert orthonormal_error(a) < TOL / 100  # > 100x margin
    assert outcome(a) == "accept"


def test_an_unconstrained_run_takes_any_finite_projector():
    """``naive`` learns its projector off the manifold: rule 15 does not apply to its runs."""
    a = np.random.default_rng(5).standard_normal((8, 4))
    assert outcome(a, UNCONSTRAINED_RUN) == "accept"
    assert outcome(STIEFEL * 1000, UNCONSTRAINED_RUN) == "accept"
    assert outcome(a, RUN) == "not_orthonormal"


def test_the_rule_is_only_for_proj():
    """A PROJ_GRAD (a gradient, not a point of the manifold) is not checked."""
    grad = Message(type=MT.PROJ_GRAD, run_id="r", src=2, dst=1, step=12, pver=12, meta={"micro_batches": 4},
                   tensors={"grad": WireTensor("fp32", STIEFEL * 1000)})
    check_content(grad, RUN, WINDOW)


# ---------------------------------------------------------------------- refused
@pytest.mark.parametrize("what, make", [
    ("scaled by 1000", lambda a: a * 1000),
    ("scaled by 2", lambda a: a * 2),
    ("scaled by 1 + 1e-3", lambda a: a * (1 + 1e-3)),  # (2ε + ε²)·√r = 4e-3
    ("zeros", np.zeros_like),
    ("a zero column", lambda a: np.concatenate([a[:, :3], np.zeros_like(a[:, :1])], axis=1)),
    ("a column repeated", lambda a: a[:, [0, 0, 2, 3]]),
    ("rank 1", lambda a: np.repeat(a[:, :1], 4, axis=1) / 2),
    ("a random Gaussian", lambda a: np.random.default_rng(7).standard_normal(a.shape)),
    ("orthogonal columns of norm sqrt(2)", lambda a: np.eye(8, 4) + np.eye(8, 4, k=-4)),
])
def test_a_projector_off_the_manifold_is_refused(what, make):
    a = make(STIEFEL.astype(np.float64))
    assert orthonormal_error(a.astype("<f4")) > TOL, what
    assert outcome(a) == "not_orthonormal", what


def test_just_beyond_the_tolerance_is_refused():
    a = haar(64, 16, seed=1).astype(np.float64)
    a[:, 0] *= 1 + 6e-4  # ‖AᵀA − I‖_F = 2ε + ε² ≈ 1.2e-3
    assert TOL < orthonormal_error(a.astype("<f4")) < 1.3e-3
    assert outcome(a) == "not_orthonormal"


def test_a_small_dense_perturbation_is_refused():
    a = haar(256, 64, seed=2).astype(np.float64)
    a += 1e-4 * np.random.default_rng(9).standard_normal(a.shape)  # every entry off by ~1e-4
    assert orthonormal_error(a.astype("<f4")) > TOL
    assert outcome(a) == "not_orthonormal"


def test_a_bf16_rounded_projector_is_refused():
    """Why PROJ is fp32 (SPEC §4): a bf16 copy of an orthonormal matrix is already past the tolerance."""
    a = bf16_round(haar(64, 16, seed=4))
    assert 2e-3 < orthonormal_error(a) < 2e-2
    assert outcome(a) == "not_orthonormal"


def test_the_text_names_the_measured_value_and_the_tolerance():
    with pytest.raises(ContentError) as info:
        check_content(proj(STIEFEL * 2), RUN, WINDOW)
    e = info.value
    assert e.code == "not_orthonormal" and str(e).startswith("not_orthonormal: ")
    assert "PROJ version 13" in e.text and "is 6 off orthonormal" in e.text
    assert f"the tolerance is {TOL:g}" in e.text and "0.001" in e.text


# ---------------------------------------------------------------------- order of the rules
def test_earlier_rules_decide_first():
    bad = STIEFEL * 2
    assert outcome_of(proj(bad, pver=14)) == "stale_projector"  # rule 6
    nan = bad.copy()
    nan[0, 0] = np.nan
    assert outcome_of(proj(nan)) == "non_finite"  # rule 13 before 15
    assert outcome_of(proj(bad.T)) == "wrong_shape"  # rule 10
    fixed = replace(RUN, trainable_projector=False)
    assert outcome_of(proj(bad), fixed) == "not_allowed"  # rule 1


def outcome_of(msg: Message, run: RunShapes = RUN) -> str:
    try:
        check_content(msg, run, WINDOW)
    except ContentError as e:
        return e.code
    return "accept"


def test_orthonormal_error_is_the_frobenius_norm_in_fp64():
    a = np.zeros((3, 2), "<f4")
    assert orthonormal_error(a) == pytest.approx(np.sqrt(2))
    assert orthonormal_error(np.eye(3, 2, dtype="<f4") * 3) == pytest.approx(8 * np.sqrt(2))
    assert orthonormal_error(np.eye(5, 5, dtype="<f4")) == 0.0
