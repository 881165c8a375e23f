"""A short MAPL+VQ training run on the embedded corpus lowers the validation loss; bytes as accounted."""

from mapl_swarm.compress import config_boundary_bytes
from mapl_swarm.config import config_from_dict
from mapl_swarm.pipeline.trainer import train


def test_short_mapl_vq_training_lowers_val_loss(tmp_path):
    cfg = config_from_dict({
        "model": {"vocab_size": 512, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
                  "ffn_hidden_size": 128, "context_length": 64},
        "compression": {"codec": "mapl_vq", "rank": 16, "anchor_rank": 16,
                        "vq": {"codebook_size": 64, "slice_fraction": 0.25}},
        "optim": {"warmup_steps": 3},
        "data": {"source": "stdlib", "vocab_size": 512, "max_corpus_bytes": 400_000, "val_fraction": 0.2,
                 "cache_dir": str(tmp_path / "cache")},
        "run": {"steps": 20, "out_dir": str(tmp_path / "run")},
        "pipeline": {"num_stages": 4, "micro_batch_size": 4, "num_micro_batches": 2},
        "eval": {"interval_steps": 20, "batches": 2},
    })
    summary = train(cfg, progress=False)
    assert summary.initial_val_loss is not None
    assert summary.final_val_loss < summary.initial_val_loss - 0.5, summary.val_history
    # measured bytes/token: codes (R x r/G = 16 B) + ids + projectors + codebook slices
    exp = config_boundary_bytes(cfg)
    assert exp.forward_act_bytes == exp.backward_bytes == 16
    micro = 20 * 2
    # one full slice (k-means init), then 16 of 64 codes per micro-batch with their uint8 index
    slices = 4 * 2 * 16 * 64 + (micro - 1) * 16 * (4 * 2 * 16 + 2 * 8)
    extra = (64 * 16 * 4 * 20 + slices) / summary.tokens
    for bpt in summary.bytes_per_token:
        assert abs(bpt["forward"] - (16 + exp.forward_ids_bytes + extra)) < 1e-6
        assert abs(bpt["backward"] - (16 + extra)) < 1e-6
