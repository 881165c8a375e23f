"""In-process training must work on a bare CUDA box: no pyzmq, lz4 or hivemind needed."""

import subprocess
import sys

SCRIPT = r"""
import sys
for name in ("zmq", "lz4", "lz4.frame", "hivemind", "msgpack"):
    sys.modules[name] = None  # importing any of them now raises ImportError
import torch
from mapl_swarm.config import config_from_dict
from mapl_swarm.pipeline.inprocess import InProcessPipeline
import mapl_swarm.pipeline.trainer, mapl_swarm.data, mapl_swarm.optim, mapl_swarm.compress, mapl_swarm.cli
cfg = config_from_dict({"model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                  "ffn_hidden_size": 64, "context_length": 8},
                        "compression": {"rank": 8, "anchor_rank": 8}, "pipeline": {"num_stages": 2}})
pipe = InProcessPipeline(cfg)
res = pipe.train_step([torch.randint(0, 64, (2, 9))])
print("ok", res.loss)
"""


def test_in_process_stack_imports_without_network_packages():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ")
