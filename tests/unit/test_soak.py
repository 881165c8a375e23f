"""The pure parts of ``bench/soak.py``: /proc and log parsing, the growth and throughput figures, the
summary and its table. No process is started here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STATUS = """Name:\tpython
Umask:\t0022
State:\tS (sleeping)
Pid:\t4242
PPid:\t4200
VmPeak:\t 3000000 kB
VmHWM:\t  614400 kB
VmRSS:\t  563200 kB
RssAnon:\t  400000 kB
RssFile:\t  163200 kB
Threads:\t13
"""


def test_parse_status_reads_rss_peak_anon_and_threads(soak):
    assert soak.parse_status(STATUS) == {"hwm_mb": 600.0, "rss_mb": 550.0, "anon_mb": 400000 / 1024, "threads": 13}
    assert soak.parse_status("Name:\tkthreadd\nThreads:\t1\n") == {"threads": 1}  # a kernel thread has no Vm*


def test_parse_stat_counts_fields_after_the_last_parenthesis(soak):
    tail = " ".join(str(i) for i in range(5, 30))  # fields 5.. of proc(5)
    assert soak.parse_stat(f"4242 (python) S 4200 {tail}") == (4200, 22)
    assert soak.parse_stat(f"4243 (a) b (c) S 4242 {tail}") == (4242, 22)  # a name with spaces and ')'


def test_peer_stage_from_command_lines(soak):
    peer = ["/venv/bin/python", "-m", "mapl_swarm", "peer", "--config", "/tmp/peer/s.toml", "--stage", "3",
            "--initial-peer", "/ip4/127.0.0.1/tcp/1/p2p/x", "--launched", ""]
    assert soak.peer_stage(peer) == 3
    assert soak.peer_stage(["python", "-m", "mapl_swarm", "launch", "--config", "peer"]) is None
    assert soak.peer_stage(["python", "-m", "mapl_swarm", "peer", "--stage"]) is None
    assert soak.peer_stage([""]) is None


def test_parse_reject_reads_the_reject_counter_log_line(soak):
    line = ("16:01:33 WARNING mapl_swarm.peer.runtime: stage2: dropped a message from 'stage1:ab(c)': "
            "header says ACT (bad) (malformed_header, 17 so far)")
    assert soak.parse_reject(line) == (2, "malformed_header", 17)
    assert soak.parse_reject("16:01:33 INFO mapl_swarm.peer.runtime: stage1: handshake done with stages [0, 2]") is None


def test_codebook_rejects_keeps_the_latest_cumulative_counters(soak):
    into: dict[str, float] = {}
    soak.codebook_rejects({"step": 1, "vq_act_rx_rejected": 0.0, "vq_act_perplexity": 60.0}, into)
    soak.codebook_rejects({"step": 2, "vq_act_rx_rejected": 2.0, "vq_grad_rx_rejected": 1.0}, into)
    assert into == {"vq_act_rx_rejected": 2.0, "vq_grad_rx_rejected": 1.0}


def test_line_tail_returns_complete_lines_once(soak, tmp_path):
    path = tmp_path / "m.jsonl"
    tail = soak.LineTail(path)
    assert tail.read() == []  # not there yet
    path.write_bytes(b'{"step": 1}\n{"st')
    assert tail.read() == ['{"step": 1}']
    assert tail.read() == []
    with path.open("ab") as fh:
        fh.write(b'ep": 2}\n')
    assert tail.read() == ['{"step": 2}']


def test_soak_windows(soak):
    assert soak.soak_windows(30 * 60) == (300.0, 180.0)  # warm-up capped at 5 minutes
    assert soak.soak_windows(120) == pytest.approx((24.0, 12.0))


def test_growth_compares_window_medians(soak):
    flat = [(float(t), 500.0) for t in range(0, 1801, 10)]
    g = soak.growth(flat, 300, 180)
    assert g == {"warm_mb": 500.0, "final_mb": 500.0, "growth_pct": 0.0, "peak_mb": 500.0}
    # 500 MiB in the warm window, 520 in the final one, a spike in between, noise from startup
    series = [(0.0, 900.0)] + [(float(t), 500.0) for t in range(300, 481, 10)] + [(1000.0, 800.0)]
    series += [(float(t), 520.0) for t in range(1620, 1801, 10)]
    g = soak.growth(series, 300, 180)
    assert g["warm_mb"] == 500.0 and g["final_mb"] == 520.0 and g["peak_mb"] == 900.0
    assert g["growth_pct"] == pytest.approx(4.0)
    # the median ignores one outlier in a window
    g = soak.growth([(300.0, 500.0), (310.0, 5000.0), (320.0, 500.0), (1790.0, 510.0), (1800.0, 510.0)], 300, 180)
    assert g["warm_mb"] == 500.0 and g["growth_pct"] == pytest.approx(2.0)


def test_growth_without_samples_in_a_window_is_none(soak):
    assert soak.growth([], 300, 180)["growth_pct"] is None
    assert soak.growth([(10.0, 500.0), (1800.0, 510.0)], 300, 180)["growth_pct"] is None  # nothing after warm-up
    short = [(float(t), 500.0 + t) for t in range(0, 601, 10)]  # the final window overlaps the warm one
    assert soak.growth(short, 300, 180)["growth_pct"] is None and soak.growth(short, 300, 140)["growth_pct"] > 0


def test_rate_of_a_cumulative_counter(soak):
    points = [(float(t), 100.0 * t) for t in range(0, 101, 5)]
    assert soak.rate(points, 20, 100) == pytest.approx(100.0)
    assert soak.rate(points, 21, 24) is None
    assert soak.rate([(1.0, 5.0), (1.0, 9.0)], 0, 2) is None


def _sample(t: float | None, stage_rss: list[float], tokens: int, **extra) -> dict:
    procs = {f"stage{k}": {"rss_mb": rss, "hwm_mb": rss + 10, "threads": 13, "fds": 49, "pids": [100 + k]}
             for k, rss in enumerate(stage_rss)}
    procs["stage0/helpers"] = {"rss_mb": 370.0, "hwm_mb": 370.0, "threads": 10, "fds": 49, "pids": [200]}
    return {"wall_s": 0.0, "t_s": t, "steps": tokens // 1024, "tokens": tokens, "procs": procs,
            "logged_rejects": extra.get("logged", {}), "codebook_rejects": extra.get("live", {})}


def test_summarize_passes_flat_stages_and_reads_rejects(soak):
    samples = [_sample(None, [300.0, 300.0], 0)]  # startup: before the first step, not counted
    samples += [_sample(float(t), [500.0, 600.0], 400 * t) for t in range(0, 121, 5)]
    samples[-1]["logged_rejects"] = {"stage1": {"replay": 2}}
    samples[-1]["codebook_rejects"] = {"stage1": {"vq_act_rx_rejected": 3.0}}
    results = {"stage0": {"bad_frames": 1, "rejects": {"wrong_session": 1}, "codebooks_rejected": {}}}
    s = soak.summarize(samples, 120, results, 5.0)
    assert s["ok"] and s["warmup_s"] == 24.0 and s["soaked_s"] == 120.0
    assert s["procs"]["stage1"]["growth_pct"] == 0.0 and s["procs"]["stage1"]["hwm_mb"] == 610.0
    assert s["procs"]["stage0"]["threads"] == [13, 13]
    assert s["tokens_per_s_after_warmup"] == pytest.approx(400.0)
    assert s["tokens"] == 48000 and s["steps"] == 46
    assert s["rejects"]["stage0"] == {"total": 1, "by_code": {"wrong_session": 1}, "codebook_slices": 0,
                                      "source": "result"}
    assert s["rejects"]["stage1"] == {"total": 2, "by_code": {"replay": 2}, "codebook_slices": 3.0,
                                      "source": "log and metrics"}
    table = soak.summary_table(s)
    assert "| stage1 | 600.0 | 600.0 | +0.00 | 600.0 / 610.0 | 13 -> 13 | 49 -> 49 |" in table
    assert "tokens/s after warm-up 400.0" in table and table.splitlines()[-1].startswith("PASS")


def test_summarize_fails_a_stage_that_grows(soak):
    samples = [_sample(float(t), [500.0, 500.0 + (60.0 if t >= 100 else 0.0)], 100 * t) for t in range(0, 121, 5)]
    s = soak.summarize(samples, 120, {}, 5.0)
    assert not s["ok"]
    assert s["procs"]["stage0"]["growth_pct"] == 0.0 and s["procs"]["stage1"]["growth_pct"] == pytest.approx(12.0)
    assert soak.summary_table(s).splitlines()[-1].startswith("FAIL")


def test_summarize_with_no_step_or_one_sample_is_not_ok(soak):
    s = soak.summarize([_sample(None, [300.0], 0)], 120, {}, 5.0)
    assert not s["ok"] and s["procs"] == {} and s["tokens_per_s_after_warmup"] is None
    assert "FAIL" in soak.summary_table(s)
    s = soak.summarize([_sample(None, [300.0], 0), _sample(0.0, [500.0], 1024)], 0.0, {}, 5.0)  # stopped at once
    assert not s["ok"] and s["procs"]["stage0"]["growth_pct"] is None


def test_descendants_walks_the_process_tree(soak):
    table = {10: (1, 0), 11: (10, 0), 12: (10, 0), 13: (11, 0), 14: (13, 0), 20: (1, 0)}
    assert sorted(soak._descendants(table, 10)) == [11, 12, 13, 14]
    assert soak._descendants(table, 20) == []
