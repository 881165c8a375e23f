"""User-facing error types.

Every error a user can cause (bad config, missing file, wrong protocol version...) is raised
as a subclass of :class:`MaplError`; the CLI prints its message on one line and exits non-zero
instead of showing a traceback.
"""

__all__ = ["MaplError", "ConfigError", "DataError", "CheckpointError"]


class MaplError(Exception):
    """Base class of errors caused by user input or environment, reported without traceback."""


class ConfigError(MaplError):
    """Invalid configuration value, unknown key, or impossible setting."""


class DataError(MaplError):
    """Missing or unusable corpus, tokenizer or token shards."""


class CheckpointError(MaplError):
    """Missing, incomplete or incompatible checkpoint."""
