"""What a stage peer does after each optimizer step: its health record and its checkpoint.

The schedule calls one :data:`~.schedule.StepEndHook` after a step's flush (the optimizer step and
the new projector sent); this is the default one, built by :func:`~.main.build_peer`. It is the run
policy's part of a peer (cadence, where records and checkpoints go), kept apart from the schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mapl_swarm.pipeline import checkpoint
from mapl_swarm.pipeline.probe import append_health

if TYPE_CHECKING:
    from mapl_swarm.config import TrainConfig
    from mapl_swarm.peer.compute import ComputeThread
    from mapl_swarm.pipeline.stage import StageRuntime

__all__ = ["HealthAndCheckpoint"]


class HealthAndCheckpoint:
    """Append the step's health metrics; save this stage's checkpoint every
    ``run.checkpoint_interval_steps`` and after the last step (on the compute thread)."""

    def __init__(self, cfg: TrainConfig, stage: int, runtime: StageRuntime, compute: ComputeThread, *,
                 sampler: Any = None) -> None:
        self.cfg, self.stage, self.rt, self.compute, self.sampler = cfg, stage, runtime, compute, sampler

    async def __call__(self, done: int, step_metrics: dict) -> None:
        run = self.cfg.run
        append_health(run.out_dir, self.stage, done, step_metrics)  # run.health_interval_steps
        every = run.checkpoint_interval_steps
        if every and (done % every == 0 or done == run.steps):
            state = await self.compute.run(self.rt.state_dict)  # clones device tensors: in the worker
            if self.sampler is not None:
                state["data"] = self.sampler.state_dict()
            await self.compute.run(checkpoint.save_stage, run.out_dir, done, self.stage, state)
