"""A 4-peer MAPL+VQ swarm over ZeroMQ equals the single-process run; codebooks stay in sync."""

import json

import pytest

from mapl_swarm.compress import config_boundary_bytes
from mapl_swarm.config import load_config
from mapl_swarm.launch import launch
from mapl_swarm.pipeline.trainer import train

from swarm_helpers import train_losses, write_config

pytestmark = pytest.mark.timeout(420)  # ~50 s on the 2-core machine


def test_four_peer_vq_swarm_matches_single_process(tmp_path):
    path = write_config(tmp_path / "vq.toml", codec="mapl_vq", cache=tmp_path / "cache", out=tmp_path / "swarm",
                        run_id="eq-vq", steps=3)
    path.write_text(path.read_text().replace(
        "anchor_rank = 16\n", "anchor_rank = 16\nvq = {codebook_size = 32, slice_fraction = 0.25}\n"))
    cfg = load_config(path)
    summary = launch(cfg, ["--config", str(path)], progress=False, timeout_s=360)
    ref_cfg = load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}})
    ref = train(ref_cfg, progress=False)
    ref_losses = train_losses(tmp_path / "ref")
    assert summary.train_losses == pytest.approx(ref_losses, rel=1e-3)
    assert summary.val_history[-1][1] == pytest.approx(ref.final_val_loss, rel=1e-3)
    peers = [json.loads((tmp_path / "swarm" / f"peer_stage{s}.json").read_text()) for s in range(4)]
    micro = 3 * 3
    for b in range(3):  # sender mirror == receiver codebooks on both streams of every boundary
        up, down = peers[b]["codebooks"], peers[b + 1]["codebooks"]
        assert up["digests"]["tx_act"] == down["digests"]["rx_act"]
        assert down["digests"]["tx_grad"] == up["digests"]["rx_grad"]
        assert up["versions"]["tx_act"] == down["versions"]["tx_grad"] == micro
        assert up["rejected"] == down["rejected"] == {}
    # every slice applied, in order: one per micro-batch and received stream (2 for middle stages)
    assert [p["codebooks"]["applied"] for p in peers] == [micro, 2 * micro, 2 * micro, micro]
    exp = config_boundary_bytes(cfg)
    assert exp.forward_act_bytes == exp.backward_bytes == 16  # R x r/G = 2 x 8 one-byte codes per token
    s = 4 * 2 * 16  # fp32 bytes per code index over all codebooks: 4 x R x r/G x G
    ix = 2 * 8  # an indexed (priority) slice adds one uint8 index per code and codebook: R x r/G
    slices = (32 * s + (micro - 1) * 8 * (s + ix)) / summary.tokens  # k-means init slice is full, then 8 of 32
    for link in summary.links:  # measured payload bytes/token by kind equal the accounting exactly
        kinds = link["payload_by_kind"]
        assert kinds["fwd_act"] == pytest.approx(exp.forward_act_bytes, rel=1e-9)
        assert kinds["fwd_ids"] == pytest.approx(exp.forward_ids_bytes, rel=1e-9)
        assert kinds["bwd_grad"] == pytest.approx(exp.backward_bytes, rel=1e-9)
        assert kinds["fwd_codebook"] == kinds["bwd_grad_codebook"] == pytest.approx(slices, rel=1e-9)
        assert link["forward_payload"] == pytest.approx(
            kinds["fwd_act"] + kinds["fwd_ids"] + kinds["fwd_proj"] + kinds["fwd_codebook"], rel=1e-9)
