"""Step progress off a terminal: log lines, not carriage-return redraws."""

import logging

from mapl_swarm.metrics.progress import StepProgress


def test_off_a_terminal_it_logs_a_line_per_interval_and_at_the_end(caplog, capsys):
    caplog.set_level(logging.INFO, logger="mapl_swarm.metrics.progress")
    p = StepProgress(3, initial=0, desc="swarm mapl P=4", terminal=False, interval_s=3600)
    p.step(loss="5.100")
    p.step(loss="5.000")
    p.step(loss="4.900", tok_s="1200")
    p.close()
    assert [r.getMessage() for r in caplog.records] == ["swarm mapl P=4: step 3/3, loss 4.900, tok_s 1200"]
    assert "\r" not in capsys.readouterr().err


def test_interval_zero_logs_every_step_and_disabled_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="mapl_swarm.metrics.progress")
    p = StepProgress(10, initial=4, desc="train mapl", terminal=False, interval_s=0)
    p.step(loss="1.0")
    p.step()
    StepProgress(10, desc="quiet", enabled=False, terminal=False, interval_s=0).step(loss="1.0")
    assert [r.getMessage() for r in caplog.records] == ["train mapl: step 5/10, loss 1.0", "train mapl: step 6/10"]


def test_on_a_terminal_it_is_a_bar(capsys):
    p = StepProgress(2, desc="bar", terminal=True)
    p.step(loss="1.0")
    p.close()
    assert "bar:  50%" in capsys.readouterr().err
