"""Micro-batches of token windows: a resumable shuffled sampler and fixed validation batches.

A shard of N tokens holds ``(N - 1) // seq_len`` non-overlapping windows; window k starts at
``k * seq_len`` and takes ``seq_len + 1`` ids, so every sequence carries its own next-token
labels (inputs ``w[:-1]``, labels ``w[1:]``). Consecutive windows share one boundary token.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from mapl_swarm.errors import DataError

__all__ = ["BatchSampler", "validation_batches", "num_windows"]

logger = logging.getLogger(__name__)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Number of whole ``seq_len + 1``-id windows at stride ``seq_len`` in ``num_tokens`` ids."""
    return max(num_tokens - 1, 0) // seq_len


def _check(tokens: np.ndarray, micro_batch_size: int, seq_len: int) -> int:
    if micro_batch_size <= 0 or seq_len <= 0:
        raise DataError(f"micro_batch_size and seq_len must be positive, got {micro_batch_size}, {seq_len}")
    if tokens.ndim != 1:
        raise DataError(f"token shard must be 1-D, got shape {tuple(tokens.shape)}")
    count = num_windows(len(tokens), seq_len)
    if count == 0:
        raise DataError(f"token shard of {len(tokens)} tokens is too short for one window of "
                        f"{seq_len + 1} tokens (seq_len {seq_len}); use more data or a shorter context")
    return count


def _gather(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> torch.Tensor:
    index = windows[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))  # (B, T+1) int64


class BatchSampler:
    """Endless shuffled micro-batches of shape (micro_batch_size, seq_len + 1), dtype int64.

    Each epoch visits every window once in ``np.random.default_rng([seed, epoch])``'s
    permutation; a micro-batch that reaches the end of an epoch continues with the next one.
    The position is ``{"epoch": e, "cursor": c}`` (c windows of epoch e already used), so
    :meth:`load_state_dict` with a saved :meth:`state_dict` resumes the identical stream.
    """

    def __init__(self, tokens: np.ndarray, micro_batch_size: int, seq_len: int, seed: int) -> None:
        self.num_windows = _check(tokens, micro_batch_size, seq_len)
        """Windows per epoch."""
        self.tokens = tokens
        self.micro_batch_size = micro_batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_windows)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> torch.Tensor:
        """The next micro-batch, (micro_batch_size, seq_len + 1) int64 on the CPU."""
        picked = np.empty(self.micro_batch_size, dtype=np.int64)
        filled = 0
        while filled < self.micro_batch_size:
            if self.cursor == self.num_windows:
                self.epoch += 1
                self.cursor = 0
            take = min(self.micro_batch_size - filled, self.num_windows - self.cursor)
            picked[filled:filled + take] = self._permutation()[self.cursor:self.cursor + take]
            filled += take
            self.cursor += take
        if self.cursor == self.num_windows:  # report a finished epoch as the next one's start
            self.epoch += 1
            self.cursor = 0
        return _gather(self.tokens, picked, self.seq_len)

    def batch_at(self, index: int) -> torch.Tensor:
        """The ``index``-th micro-batch of the stream (0-based, from epoch 0), whatever the current
        position, which it leaves as it was: the micro-batch a replica draws for a global
        micro-batch index (:mod:`mapl_swarm.step.assignment`)."""
        if index < 0:
            raise DataError(f"micro-batch index {index} is negative")
        saved = self.epoch, self.cursor
        self.epoch, self.cursor = divmod(index * self.micro_batch_size, self.num_windows)
        try:
            return self.next_batch()
        finally:
            self.epoch, self.cursor = saved

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Position in the stream: ``{"epoch": e, "cursor": c}``."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a position returned by :meth:`state_dict`."""
        try:
            epoch, cursor = int(state["epoch"]), int(state["cursor"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"bad batch sampler state {state!r}: "
                            "expected {'epoch': int, 'cursor': int}") from None
        if epoch < 0 or not 0 <= cursor <= self.num_windows:
            raise DataError(f"batch sampler state {state!r} is out of range for {self.num_windows} windows")
        self.epoch, self.cursor = epoch, cursor


def validation_batches(tokens: np.ndarray, micro_batch_size: int, seq_len: int,
                       num_batches: int) -> list[torch.Tensor]:
    """The first ``num_batches * micro_batch_size`` windows in order, as fixed micro-batches.

    The result is the same on every call. When the shard has fewer windows than asked for, the
    windows repeat cyclically (with a warning) so the shapes stay fixed.
    """
    count = _check(tokens, micro_batch_size, seq_len)
    if num_batches <= 0:
        raise DataError(f"num_batches must be positive, got {num_batches}")
    wanted = num_batches * micro_batch_size
    if wanted > count:
        logger.warning("validation shard has %d windows, fewer than the %d asked for; windows repeat",
                       count, wanted)
    windows = np.arange(wanted, dtype=np.int64) % count
    return [_gather(tokens, windows[i * micro_batch_size:(i + 1) * micro_batch_size], seq_len)
            for i in range(num_batches)]
