"""Liveness deadlines from measured round trips (issue 13 item 2, SPEC §9.5), on fake clocks."""

from __future__ import annotations

import asyncio

import pytest

from mapl_swarm.errors import ConfigError
from mapl_swarm.net.heartbeat import (GapTracker, HeartbeatConfig, HeartbeatMonitor, RttEstimator,
                                      liveness_deadline, rtt_sample_s)

from conftest import micro_config

CFG = HeartbeatConfig(interval_s=2.0, timeout_s=120.0, floor_s=10.0)


# ---------------------------------------------------------------------- the formula
@pytest.mark.parametrize("estimate, deadline", [
    (None, 120.0),  # nothing measured yet (or a peer that does not echo): the ceiling
    (0.0003, 10.0),  # loopback: 4 x 0.3 ms + 2 x 2 s = 4 s, below the floor
    (1.5, 10.0),  # 4 x 1.5 + 4 = 10: exactly the floor
    (5.0, 24.0),  # a slow or queued link: 4 x 5 + 4
    (40.0, 120.0),  # 164 s: capped at the ceiling
])
def test_deadline_is_k_rtt_plus_two_intervals_clamped_to_floor_and_ceiling(estimate, deadline):
    assert liveness_deadline(estimate, CFG) == pytest.approx(deadline)


@pytest.mark.parametrize("estimate, gap, deadline", [
    (5.0, None, 24.0),  # not watched for a full window: the round trip alone
    (5.0, 1.0, 10.0),  # a queued round trip, messages every second: the gaps, up to the floor
    (5.0, 4.0, 16.0),  # 4 x the longest gap, below 4 x 5 + 4
    (None, 4.0, 16.0),  # a peer that does not echo: its gaps
    (0.0003, 20.0, 10.0),  # the shorter rule: the round trip's
])
def test_the_longest_gap_shortens_a_round_trip_deadline(estimate, gap, deadline):
    assert liveness_deadline(estimate, CFG, gap) == pytest.approx(deadline)


def test_without_a_floor_the_deadline_is_fixed():
    fixed = HeartbeatConfig(interval_s=2.0, timeout_s=30.0)
    assert [liveness_deadline(e, fixed) for e in (None, 0.001, 100.0)] == [30.0, 30.0, 30.0]


def test_rtt_estimator_follows_rfc_6298():
    est = RttEstimator()
    assert est.estimate is None
    est.add(0.1)
    assert (est.srtt, est.rttvar, est.estimate) == pytest.approx((0.1, 0.05, 0.3))
    est.add(0.3)  # rttvar = 3/4 x 0.05 + 1/4 x |0.1 - 0.3|; srtt = 7/8 x 0.1 + 1/8 x 0.3
    assert (est.srtt, est.rttvar) == pytest.approx((0.125, 0.0875))
    assert est.estimate == pytest.approx(0.125 + 4 * 0.0875)
    est.add(float("nan"))
    est.add(-1.0)
    assert est.samples == 2  # nonsense is ignored


@pytest.mark.parametrize("echo, held, sample", [
    (1_000, 500, 0.0000085),  # 10_000 - 1_000 - 500 ns
    (10_000, 0, 0.0),
    (9_000, 2_000, None),  # held longer than the round trip: a sample from the future
    (-1, 0, None),
    ("1", 0, None),
    (1_000, 1.5, None),
    (True, 0, None),
])
def test_one_sample_from_an_echo(echo, held, sample):
    got = rtt_sample_s(10_000, echo, held)
    assert got == (None if sample is None else pytest.approx(sample))


def test_config_checks():
    with pytest.raises(ConfigError, match="floor_s"):
        HeartbeatConfig(interval_s=2.0, timeout_s=30.0, floor_s=1.0)
    with pytest.raises(ConfigError, match="floor_s"):
        HeartbeatConfig(interval_s=2.0, timeout_s=30.0, floor_s=40.0)
    with pytest.raises(ConfigError, match="gap_window_s"):
        HeartbeatConfig(interval_s=2.0, timeout_s=30.0, gap_window_s=3.0)
    with pytest.raises(ConfigError, match="liveness_floor_s"):
        micro_config(net={"heartbeat_interval_s": 2.0, "liveness_floor_s": 2.0})
    with pytest.raises(ConfigError, match="liveness_ceiling_s"):
        micro_config(net={"liveness_floor_s": 10.0, "liveness_ceiling_s": 5.0})
    net = micro_config(net={"timeout_s": 6.0}).net  # a short timeout caps the floor
    assert (net.liveness_floor, net.liveness_ceiling) == (6.0, 6.0)
    net = micro_config(net={"liveness_ceiling_s": 300.0}).net
    assert (net.liveness_floor, net.liveness_ceiling) == (10.0, 300.0)


# ---------------------------------------------------------------------- the monitor, on fake clocks
async def spin(rounds: int = 5) -> None:
    """Let the tasks that are ready run (a send goes through ``wait_for``: two loop rounds)."""
    for _ in range(rounds):
        await asyncio.sleep(0)

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def s(self) -> float:
        return self.t

    def ns(self) -> int:
        return int(self.t * 1e9)


class Pair:
    """Monitors ``a`` and ``b`` on one fake clock, each watching the other; a heartbeat sent is heard
    after ``one_way_s`` (``deliver()``), or lost while ``cut`` is set."""

    def __init__(self, config: HeartbeatConfig = CFG, one_way_s: float = 0.05) -> None:
        self.clock = Clock()
        self.one_way_s = one_way_s
        self.cut = False
        self.in_flight: list[tuple[float, str, dict]] = []
        self.silent: list = []
        self.a = self._monitor("a", "b", config)
        self.b = self._monitor("b", "a", config)
        self.a.watch("b")
        self.b.watch("a")

    def _monitor(self, me: str, other: str, config: HeartbeatConfig) -> HeartbeatMonitor:
        async def send(peer: str) -> None:
            if not self.cut:
                self.in_flight.append((self.clock.t + self.one_way_s, peer, mon.heartbeat_meta(peer)))

        mon = HeartbeatMonitor(config, send=send, on_silent=self.silent.append, clock=self.clock.s,
                               clock_ns=self.clock.ns)
        mon.name = me  # type: ignore[attr-defined]
        return mon

    async def advance(self, seconds: float, step: float = 0.05) -> None:
        """Move the clock on in small steps, delivering heartbeats and running both monitors' checks."""
        end = self.clock.t + seconds
        while self.clock.t < end - 1e-9:
            self.clock.t = min(end, self.clock.t + step)
            await asyncio.sleep(0)  # let the heartbeat tasks run
            due = [m for m in self.in_flight if m[0] <= self.clock.t]
            self.in_flight = [m for m in self.in_flight if m[0] > self.clock.t]
            for _, peer, meta in due:
                receiver = self.a if peer == "a" else self.b
                sender = "b" if peer == "a" else "a"
                receiver.heard(sender)
                receiver.on_heartbeat(sender, meta)
            for mon in (self.a, self.b):
                mon._last_check = self.clock.t - mon.tick_s  # driven here, not late
                mon.check()
            await asyncio.sleep(0)


def test_round_trips_are_measured_from_echoes_and_set_the_deadline():
    async def main():
        p = Pair(one_way_s=0.05)
        await p.advance(0.5)
        assert p.a.rtt("b").samples >= 1 and p.b.rtt("a").samples >= 1  # the first heartbeat answered at once
        await p.advance(10.0)
        rtt = p.a.rtt("b")
        assert rtt.srtt == pytest.approx(0.1, abs=0.06)  # 2 x 50 ms, to the step of the fake clock
        assert p.a.deadline_s("b") == 10.0 and p.silent == []  # fast link: the floor
        return p

    asyncio.run(main())


def test_a_peer_that_stops_is_declared_silent_after_its_deadline_once():
    async def main():
        p = Pair()
        await p.advance(5.0)
        p.cut = True  # b's heartbeats stop (and a's)
        p.in_flight.clear()
        quiet = p.a.silence_s("b")  # since b's last heartbeat
        await p.advance(9.9 - quiet)
        assert p.silent == []
        await p.advance(0.3)
        assert [s.peer for s in p.silent] == ["b", "a"]
        s = p.silent[0]
        assert 10.0 < s.silence_s < 10.4 and s.deadline_s == 10.0 and s.rtt_s is not None
        assert "silent since" in s.describe() and "deadline 10.0 s" in s.describe()
        await p.advance(5.0)
        assert len(p.silent) == 2  # reported once
        assert p.a.silent() == {"b"}
        p.a.heard("b")  # it speaks again: no longer silent
        assert p.a.silent() == set()

    asyncio.run(main())


def test_a_pause_shorter_than_the_floor_is_survived_and_a_slow_link_gets_a_longer_deadline():
    async def main():
        p = Pair(one_way_s=2.5)  # a queued link: 5 s round trips
        await p.advance(40.0, step=0.1)  # less than a gap window: the round trip rules
        assert p.a.deadline_s("b") > 20.0  # 4 x ~5 s + 4 s
        p.cut = True
        await p.advance(15.0, step=0.1)  # past the floor, within this link's deadline
        assert p.silent == []

    asyncio.run(main())


def test_a_link_whose_messages_keep_coming_keeps_a_short_deadline_however_long_its_round_trip():
    """Heartbeats that queue (5 s round trips) but arrive every interval: after a full window the
    gaps rule, 4 x 2 s below the floor; a link that had 4.4 s gaps gets 4 x 4.4 s."""
    async def main():
        p = Pair(one_way_s=2.5)
        await p.advance(CFG.gap_window_s + 5.0, step=0.1)
        assert p.a.rtt("b").estimate > 4.0 and p.a.deadline_s("b") == 10.0
        p.cut = True
        await p.advance(2.5 + 10.3, step=0.1)  # what was on its way arrives, then 10 s of silence
        assert [s.peer for s in p.silent] == ["b", "a"] and p.silent[0].deadline_s == 10.0
        gap = p.silent[0].gap_s  # a heartbeat interval, to the step of the fake clock
        assert 2.0 <= gap <= 2.2 and f"longest gap {gap:.1f} s" in p.silent[0].describe()

        q = Pair(one_way_s=2.5)
        for _ in range(4):  # now and then b's heartbeats are lost for 2.4 s: 4.4 s gaps
            await q.advance(14.0, step=0.1)
            q.cut = True
            await q.advance(2.4, step=0.1)
            q.cut = False
        await q.advance(5.0, step=0.1)
        longest = q.a._peers["b"].gaps.longest(q.clock.t)
        assert 4.0 < longest < 4.6 and q.a.deadline_s("b") == pytest.approx(4 * longest)
        assert q.silent == []

    asyncio.run(main())


def test_a_peer_whose_connection_stays_ended_for_two_intervals_is_lost_whatever_still_arrives():
    async def main():
        p = Pair()
        await p.advance(5.0)
        p.a.connection("b", False)  # its connection ended and came back within the grace
        await p.advance(3.0)
        p.a.connection("b", True)
        await p.advance(5.0)
        assert p.silent == []
        p.a.connection("b", False)  # killed: its kernel still delivers what its sockets held
        await p.advance(3.9)
        assert p.silent == [] and p.a.silence_s("b") < 2.0  # heartbeats still arrive
        await p.advance(0.2)
        assert [s.peer for s in p.silent] == ["b"]
        s = p.silent[0]
        assert s.deadline_s == 4.0 and 4.0 < s.cut_s < 4.2
        assert f"connection ended {s.cut_s:.1f} s ago, deadline 4.0 s" in s.describe()
        await p.advance(1.0)
        assert len(p.silent) == 1 and p.a.silent() == {"b"}  # heard, but lost once, until it comes back
        p.a.connection("nobody", False)  # not watched: ignored

    asyncio.run(main())


def test_gap_tracker_keeps_the_longest_gap_of_its_window():
    gaps = GapTracker(10.0, now=0.0)
    for t in (1.0, 4.0, 4.5, 6.0):  # gaps 1, 3, 0.5, 1.5
        gaps.heard(t)
    assert gaps.longest(9.0) is None  # not watched for a full window yet
    assert gaps.longest(12.0) == 3.0
    assert gaps.longest(14.1) == 1.5  # the 3 s gap ended at 4.0, out of the window
    assert gaps.longest(16.1) == 0.0  # nothing heard within the window
    gaps.skip(5.0, now=20.0)  # this process stopped for 5 s: not the peer's gap
    gaps.heard(20.0)
    assert gaps.longest(20.0) == pytest.approx(9.0)


def test_a_monitor_that_did_not_run_does_not_blame_its_neighbours():
    """Checks that run much later than planned (this process was stopped or its loop blocked) move
    the silence clocks on by the gap."""
    async def main():
        clock = Clock()

        async def send(peer):
            return None

        silent = []
        mon = HeartbeatMonitor(CFG, send=send, on_silent=silent.append, clock=clock.s, clock_ns=clock.ns)
        mon.watch("b")
        mon.on_heartbeat("b", {"sent_ns": 1, "echo_ns": clock.ns() - 1_000_000, "held_ns": 0})  # 1 ms
        assert mon.deadline_s("b") == CFG.floor
        mon.check()
        clock.t += 30.0  # nothing ran for 30 s
        mon.check()
        assert silent == []
        clock.t += CFG.floor + 0.1 + mon.tick_s
        mon._last_check = clock.t - mon.tick_s
        mon.check()  # 10 s of real silence after it runs again
        assert [s.peer for s in silent] == ["b"]
        await mon.aclose()

    asyncio.run(main())


def test_a_heartbeat_heard_before_watching_is_echoed_and_a_send_in_flight_is_not_doubled():
    async def main():
        clock = Clock()
        sent = []
        release = asyncio.Event()

        async def send(peer):
            sent.append(mon.heartbeat_meta(peer))
            await release.wait()  # a full send buffer: the heartbeat is still on its way

        mon = HeartbeatMonitor(CFG, send=send, clock=clock.s, clock_ns=clock.ns).start()
        mon.on_heartbeat("b", {"sent_ns": 777})  # b's heartbeat came before b welcomed this peer
        clock.t += 0.25
        mon.watch("b")  # the first heartbeat goes at once, with the echo
        await spin()
        assert sent == [{"sent_ns": clock.ns(), "echo_ns": 777, "held_ns": 250_000_000}]
        clock.t += 5.0
        mon._last_check = clock.t - mon.tick_s
        mon.check()  # due again, but the first is still being sent: no second one behind it
        await spin()
        assert len(sent) == 1
        release.set()
        await spin()
        mon.check()
        await spin()
        assert len(sent) == 2
        mon.forget("b")
        assert mon.silent() == set() and mon.rtt("b") is None
        await mon.aclose()

    asyncio.run(main())
