"""Device selection (issue 10, item 5): ``runtime.device`` values, their resolution, the per-thread
binding of the compute thread, and the per-child GPU environment ``launch`` builds (all on CPU)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from mapl_swarm.config import RuntimeConfig, config_from_dict
from mapl_swarm.errors import ConfigError
from mapl_swarm.peer.compute import ComputeThread
from mapl_swarm.launch import gpu_plan, parse_gpus, peer_processes, visible_gpus
from mapl_swarm.pipeline.device import bind_device, resolve_device

from conftest import capture_launch


# ---------------------------------------------------------------- runtime.device values
@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:15"])
def test_device_values_that_load(value):
    assert config_from_dict({"runtime": {"device": value}}).runtime.device == value
    assert RuntimeConfig(device=value).device == value


@pytest.mark.parametrize("value", ["cuda:", "cuda:-1", "cuda:x", "cuda1", "cuda:1 ", "CUDA:0", "gpu:0", "mps"])
def test_bad_device_values_name_the_allowed_forms(value):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"runtime": {"device": value}})
    msg = str(err.value)
    assert msg.startswith("runtime.device must be one of ('auto', 'cpu', 'cuda') or 'cuda:N'"), msg
    assert msg.endswith(f"got {value!r}"), msg


def test_resolve_device_cpu_and_auto_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=f"runtime.device is {name} but no CUDA device is available"):
            resolve_device(name)


def test_resolve_device_index_beyond_the_visible_count_names_both(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("auto") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"runtime.device is cuda:2 but only 2 CUDA devices are visible "
                                          r"\(cuda:0..cuda:1\); CUDA_VISIBLE_DEVICES='4,5'"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"cuda:7 but only 1 CUDA device is visible"):
        resolve_device("cuda:7")


def test_bind_device_sets_the_calling_threads_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
    bind_device(torch.device("cpu"))
    bind_device("cpu")
    assert calls == []
    bind_device("cuda:3")
    bind_device(torch.device("cuda"))
    assert calls == [3, 0]


# ---------------------------------------------------------------- the compute thread binds itself
def test_compute_thread_initializer_runs_on_the_worker_thread():
    seen: dict[str, object] = {}
    device = resolve_device("cpu")

    def init() -> None:
        bind_device(device)  # what build_peer passes (functools.partial(bind_device, device))
        seen["init"] = threading.get_ident()

    async def main() -> tuple[int, int]:
        compute = ComputeThread("t", initializer=init)
        try:
            first = await compute.run(threading.get_ident)
            second = await compute.run(threading.get_ident)
        finally:
            compute.close()
        return first, second

    first, second = asyncio.run(main())
    assert seen["init"] == first == second
    assert first != threading.get_ident()


def test_build_peer_binds_the_device_in_its_thread_and_in_the_compute_thread(monkeypatch):
    """build_peer resolves runtime.device, binds it in the calling (event-loop) thread and gives the
    compute thread an initializer that binds it there (the parts that need data are stubbed)."""
    import types

    import mapl_swarm.config
    import mapl_swarm.data
    import mapl_swarm.peer.checkpoints
    import mapl_swarm.peer.runtime
    import mapl_swarm.pipeline.stage
    from mapl_swarm.peer import main
    from mapl_swarm.pipeline import device, run_policy

    binds: list[tuple[str, int]] = []
    built = {}
    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(device, "bind_device", lambda d: binds.append((str(d), threading.get_ident())))
    monkeypatch.setattr(run_policy, "check_vocab", lambda cfg, data: None)
    monkeypatch.setattr(mapl_swarm.data, "prepare_data", lambda *a, **k: types.SimpleNamespace(
        tokenizer=types.SimpleNamespace(file_hash="h", vocab_size=8192)))
    monkeypatch.setattr(mapl_swarm.config, "model_fingerprint", lambda *a: "fp")
    monkeypatch.setattr(mapl_swarm.pipeline.stage, "StageRuntime", lambda cfg, stage, device: types.SimpleNamespace(
        device=device, codec=types.SimpleNamespace(warm_up=lambda n: None)))
    monkeypatch.setattr(mapl_swarm.peer.checkpoints, "PeerRunPolicy", lambda *a, **k: None)
    monkeypatch.setattr(mapl_swarm.peer.runtime, "Peer", lambda *a, **k: built.update(k))

    main.build_peer(config_from_dict({}), 1, resolve=None, announce=None)
    compute = built["compute"]

    async def run() -> int:
        return await compute.run(threading.get_ident)

    try:
        worker = asyncio.run(run())
    finally:
        compute.close()
    assert binds == [("cpu", threading.get_ident()), ("cpu", worker)]
    assert worker != threading.get_ident()


# ---------------------------------------------------------------- launch: GPUs per child
def _plan(n, *, gpus=None, environ=None, count=0, device="auto"):
    return gpu_plan(device, n, gpus=gpus, environ={} if environ is None else environ, probe=lambda: count)


def test_gpu_plan_round_robin_over_visible_gpus():
    assert _plan(4, count=4) == ["0", "1", "2", "3"]
    assert _plan(4, count=1) == ["0", "0", "0", "0"]  # one H200, four peers: all share it
    assert _plan(4, count=2, device="cuda") == ["0", "1", "0", "1"]
    assert _plan(4, gpus=parse_gpus("2,3"), count=8) == ["2", "3", "2", "3"]
    assert _plan(4, environ={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, count=8) == ["4", "5", "6", "7"]
    assert _plan(2, environ={"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}) == ["GPU-1a2b", "GPU-3c4d"]


def test_gpu_plan_leaves_children_alone_without_gpus_or_with_cpu_or_cuda_n():
    assert _plan(4, count=0) == [None] * 4
    assert _plan(4, environ={"CUDA_VISIBLE_DEVICES": ""}, count=4) == [None] * 4
    assert _plan(4, environ={"CUDA_VISIBLE_DEVICES": "-1"}, count=4) == [None] * 4
    assert _plan(4, count=4, device="cpu") == [None] * 4
    assert _plan(4, count=4, device="cuda:1") == [None] * 4
    for device in ("cpu", "cuda:1"):
        with pytest.raises(ConfigError, match="--gpus needs runtime.device"):
            _plan(4, gpus=["0"], device=device)


def test_visible_gpus_stops_at_the_first_invalid_entry_like_cuda():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,2,-1,3"}) == ["0", "2"]
    assert visible_gpus({}, probe=lambda: 3) == ["0", "1", "2"]


@pytest.mark.parametrize("text", ["", "0,,1", "a", "0;1", "-1", "cuda:0"])
def test_parse_gpus_rejects_what_cuda_visible_devices_cannot_take(text):
    with pytest.raises(ConfigError, match="--gpus"):
        parse_gpus(text)


def test_parse_gpus_accepts_indices_uuids_and_repeats():
    assert parse_gpus("0,1,2,3") == ["0", "1", "2", "3"]
    assert parse_gpus(" 1, 1 ") == ["1", "1"]
    assert parse_gpus("GPU-8c5e1f0e-aaaa,MIG-1b2c/1/0") == ["GPU-8c5e1f0e-aaaa", "MIG-1b2c/1/0"]


def test_peer_processes_environment_per_child():
    environ = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    plan = _plan(4, gpus=parse_gpus("2,3"), environ=environ)
    procs = peer_processes(4, ["--config", "c.toml"], maddr="/ip4/1/tcp/2/p2p/X", threads=3, progress=True,
                           gpus=plan, environ=environ, member_args=[["--peer-key", f"/ids/stage{k}.key"] for k in range(4)],
                           python="py")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in procs] == ["2", "3", "2", "3"]
    assert all(p.env["PATH"] == "/usr/bin" for p in procs)
    assert environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # the launcher's own is not touched
    assert procs[0].cmd == ["py", "-m", "mapl_swarm", "peer", "--config", "c.toml", "--stage", "0",
                            "--initial-peer", "/ip4/1/tcp/2/p2p/X", "--set", "runtime.threads=3", "--launched",
                            "--peer-key", "/ids/stage0.key"]
    assert procs[1].cmd[-1] == "--quiet" and procs[1].cmd[7] == "1" and "/ids/stage1.key" in procs[1].cmd

    one = peer_processes(4, [], maddr="m", threads=1, progress=False, environ={}, gpus=_plan(4, count=1),
                         member_args=[[]] * 4)
    assert [p.env for p in one] == [{"CUDA_VISIBLE_DEVICES": "0"}] * 4
    four = peer_processes(4, [], maddr="m", threads=1, progress=False, environ={}, gpus=_plan(4, count=4),
                          member_args=[[]] * 4)
    assert [p.gpu for p in four] == ["0", "1", "2", "3"]

    untouched = {"PATH": "/bin", "HOME": "/h"}
    none = peer_processes(4, [], maddr="m", threads=1, progress=False, environ=untouched,
                          gpus=_plan(4, environ=untouched, count=0), member_args=[[]] * 4)
    assert all(p.env == untouched and p.gpu is None for p in none)
    assert all(p.cmd[-1] == "--quiet" for p in none)


def test_launch_cli_option_reaches_launch(monkeypatch, tmp_path):
    """``mapl-swarm launch --gpus 2,3`` hands ['2', '3'] to launch(); a bad list is a one-line error."""
    from mapl_swarm import cli

    got = capture_launch(monkeypatch, "gpus")
    assert cli.main(["launch", "--gpus", "2,3", "--quiet"]) == 2
    assert got["gpus"] == ["2", "3"]
    got.clear()
    assert cli.main(["launch", "--gpus", "2;3", "--quiet"]) == 2
    assert got == {}
