"""User-facing error types.

Every error a user can cause (bad config, missing file, wrong protocol version...) is raised
as a subclass of :class:`MaplError`; the CLI prints its message on one line and exits non-zero
instead of showing a traceback: with the error's ``exit_code`` (2 unless a class says otherwise).
"""

__all__ = ["MaplError", "ConfigError", "DataError", "CheckpointError", "NonFiniteError"]


class MaplError(Exception):
    """Base class of errors caused by user input or environment, reported without traceback."""

    exit_code = 2
    """The CLI's exit status for this error."""
    label = "error"
    """The CLI's word before the message (``mapl-swarm: error: ...``)."""


class ConfigError(MaplError):
    """Invalid configuration value, unknown key, or impossible setting."""


class DataError(MaplError):
    """Missing or unusable corpus, tokenizer or token shards."""


class CheckpointError(MaplError):
    """Missing, incomplete or incompatible checkpoint."""


class MissingCheckpoints(CheckpointError):
    """A resume refused because ``stages`` hold no checkpoint of the run while every stage saved a
    step (a replacement started on a host without its stage's checkpoint folder)."""

    def __init__(self, message: str, stages: list[int]) -> None:
        super().__init__(message)
        self.stages = stages


class NonFiniteError(MaplError):
    """A NaN or Inf in this process's own compute (a loss, the gradients before the optimizer step,
    a tensor about to be sent): nothing of it was applied, sent or checkpointed. Exit status 3."""

    exit_code = 3

    def __init__(self, *, stage: int, step: int, tensor: str) -> None:
        self.stage, self.step, self.tensor = stage, step, tensor
        super().__init__(f"stage {stage}: non-finite values (NaN/Inf) in {tensor} at step {step}; "
                         f"not applied, sent or checkpointed")

    def __reduce__(self):  # keep picklable despite the keyword-only __init__
        return (_non_finite, (self.stage, self.step, self.tensor))


def _non_finite(stage: int, step: int, tensor: str) -> NonFiniteError:
    return NonFiniteError(stage=stage, step=step, tensor=tensor)
