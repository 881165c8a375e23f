"""``mapl-swarm dht`` as compose runs it: a fixed identity keeps its address across restarts, and
the address file it hands out never holds an earlier node's address."""

from __future__ import annotations

import re
import signal

from swarm_helpers import Watched, cli, identity_args


def _run_node(identity, maddrs) -> str:
    """Start the node, wait for it to be up, stop it (SIGTERM: exit 0); its peer id."""
    node = Watched(cli("dht", "--port", "0", "--identity", str(identity), "--maddr-file", str(maddrs),
                       "--cert", identity_args("dht-cli", 2, 0)[-1]))
    try:
        node.wait_for(r"DHT bootstrap node running", 60)
        written = maddrs.read_text().split()
        assert written and all(re.fullmatch(r"/ip[46]/\S+/tcp/\d+/p2p/\w+", m) for m in written), written
        ids = {m.rsplit("/p2p/", 1)[1] for m in written}
        assert len(ids) == 1
    finally:
        node.stop(signal.SIGTERM)
    assert node.proc.returncode == 0, node.output[-4000:]
    return ids.pop()


def test_identity_file_keeps_the_peer_id_and_a_stale_address_file_is_replaced(tmp_path):
    identity, maddrs = tmp_path / "dht.key", tmp_path / "shared" / "dht.maddrs"
    maddrs.parent.mkdir()
    maddrs.write_text("/ip4/10.9.9.9/tcp/1/p2p/QmStaleNodeFromAnEarlierStart\n")
    first = _run_node(identity, maddrs)
    assert identity.exists() and "QmStale" not in maddrs.read_text()
    assert _run_node(identity, maddrs) == first  # the same peer id after a restart
