"""A peer-like process for tests/integration/test_dht_lifecycle.py (not a test module).

    python dht_peer_process.py hold     # two DHT nodes, the second started on a thread that
                                        # then ends; announces, prints READY {json}, blocks
    python dht_peer_process.py sigint   # bootstrap + joined node, prints READY {json}, and on
                                        # Ctrl-C (KeyboardInterrupt) closes both, prints CLOSED

The JSON holds this process's pid and the pids of its DHT node processes. Logging goes to stderr
at INFO, so any warning of the DHT shutdown path shows up there; SIGUSR1 dumps every thread's
stack there (a test that timed out shows where the process hangs).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading

from mapl_swarm.net.discovery import Discovery, DiscoveryConfig
from mapl_swarm.procs import wait_for_signal


def main(mode: str) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks where it hangs
    # Ctrl-C raises KeyboardInterrupt even when the tests run as a background job of a shell without
    # job control, whose children start with SIGINT ignored (Python then keeps ignoring it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    config = DiscoveryConfig(host="127.0.0.1")
    nodes = [Discovery("run-lifecycle", config).start()]
    joined = DiscoveryConfig(host="127.0.0.1", initial_peers=tuple(nodes[0].visible_maddrs()))
    if mode == "sigint":
        nodes.append(Discovery("run-lifecycle", joined).start())
    else:  # a node forked on a thread outlives that thread, yet dies with this process
        nodes.append(Discovery("run-lifecycle", joined))
        starter = threading.Thread(target=nodes[-1].start)
        starter.start()
        starter.join()
    try:
        nodes[-1].announce(0, "tcp://127.0.0.1:1")
        assert nodes[0].lookup(0, timeout_s=10) == "tcp://127.0.0.1:1"
        print("READY", json.dumps({"pid": os.getpid(), "dht_pids": [n._dht.pid for n in nodes]}), flush=True)
        if mode == "hold":
            sys.stdin.read()  # until the test kills this process
        else:
            wait_for_signal()  # Ctrl-C raises KeyboardInterrupt here, whichever thread the kernel gave it to
    except KeyboardInterrupt:
        print("closing", file=sys.stderr, flush=True)
        for node in reversed(nodes):
            node.close()
        print("CLOSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
