"""Lost codebook slices in a live MAPL+VQ swarm heal by RESYNC + retransmission (SPEC §5.1, 1.2).

Two real peers (ZeroMQ over localhost, the real wire encoding, each with its compute thread) run in
one event loop with an in-memory directory instead of the DHT, so the test can lose messages on a
link: stage 0 drops the ``act`` CODEBOOK_SLICE of step 1 micro-batch 1 and stage 1 the ``grad``
slice of step 2 micro-batch 0. Without retransmission the receivers could not decode the next
codes and the run would stop; with it every micro-batch of every step trains, the codebooks end
bit-identical, and the steps before the loss equal the single-process run exactly.
"""

import asyncio

import pytest

from mapl_swarm.config import load_config
from mapl_swarm.peer.main import build_peer
from mapl_swarm.pipeline.trainer import train
from mapl_swarm.wire import MessageType

from swarm_helpers import Directory, train_losses, write_config

pytestmark = pytest.mark.timeout(300)
STEPS = 4


def lose(peer, stream: str, step: int, micro: int, lost: list) -> None:
    """Make ``peer`` silently lose its ``stream`` CODEBOOK_SLICE of (step, micro) once (on the link
    its linker makes when it serves)."""
    new_link = peer.linker.new_link

    def lossy_link(stage, contact):
        link = new_link(stage, contact)
        if link.tx_stream != stream:
            return link
        send = link.send

        async def lossy(mtype, **kw):
            if (mtype == MessageType.CODEBOOK_SLICE and kw["meta"]["stream"] == stream and not lost
                    and (kw.get("step"), kw.get("micro")) == (step, micro)):
                lost.append((stream, step, micro, kw["cver"]))
                return
            await send(mtype, **kw)

        link.send = lossy
        return link

    peer.linker.new_link = lossy_link


def test_lost_slices_are_healed_by_resync_and_retransmission(tmp_path):
    path = write_config(tmp_path / "vq.toml", codec="mapl_vq", stages=2, steps=STEPS, cache=tmp_path / "cache",
                        out=tmp_path / "swarm", run_id="retransmit", timeout=60)
    path.write_text(path.read_text().replace(
        "anchor_rank = 16\n", "anchor_rank = 16\nvq = {codebook_size = 32, slice_fraction = 0.25}\n"))
    cfg = load_config(path, {"runtime": {"threads": 1}})
    directory = Directory()
    peers = [build_peer(cfg, s, resolve=directory.resolve, announce=directory.announcer(s), progress=False)
             for s in range(2)]
    lost_act, lost_grad = [], []
    lose(peers[0], "act", 1, 1, lost_act)
    lose(peers[1], "grad", 2, 0, lost_grad)

    async def swarm():
        return await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 240)

    results = asyncio.run(swarm())
    assert lost_act and lost_grad
    M, tokens = cfg.pipeline.num_micro_batches, cfg.pipeline.micro_batch_size * cfg.model.context_length
    assert len(results[0].train_losses) == STEPS and results[0].tokens == STEPS * M * tokens

    cb0, cb1 = results[0].codebooks, results[1].codebooks
    # each receiver asked for every undecodable message again, and each request was answered
    assert cb1["retransmits_requested"] >= 1 and cb0["retransmitted"] == cb1["retransmits_requested"]
    assert cb0["retransmits_requested"] >= 1 and cb1["retransmitted"] == cb0["retransmits_requested"]
    assert cb0["digests"]["tx_act"] == cb1["digests"]["rx_act"]
    assert cb1["digests"]["tx_grad"] == cb0["digests"]["rx_grad"]

    ref = train(load_config(path, {"run": {"out_dir": str(tmp_path / "ref")}, "runtime": {"threads": 1}}),
                progress=False)
    ref_losses = train_losses(tmp_path / "ref")
    assert results[0].train_losses[0] == pytest.approx(ref_losses[0], rel=1e-4)  # before any loss
    # afterwards the healed run trains on codes of slightly different (fresher) codebooks
    assert results[0].train_losses == pytest.approx(ref_losses, rel=0.05)
    assert results[0].val_history[-1][1] == pytest.approx(ref.final_val_loss, rel=0.05)
