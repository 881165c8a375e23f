"""``mapl-swarm generate MODEL --prompt TEXT``: sample from an exported model, streaming tokens.

Temperature 0 is greedy decoding (argmax at every step); otherwise sampling at that temperature
within the ``top_p`` nucleus, seeded by ``seed``. With the KV cache (the default) each new token
costs one token's forward; ``use_cache=False`` recomputes the whole sequence every step (the same
tokens, for checking and for the benchmark).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mapl_swarm.errors import ConfigError
from mapl_swarm.hf.loading import LoadedModel

log = logging.getLogger(__name__)

__all__ = ["Generation", "generate"]


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    """The new tokens, decoded."""
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / max(self.seconds, 1e-9)


class _Stream:
    """transformers' streamer protocol: ``put(ids)`` / ``end()``; hands each newly complete piece of
    text to ``write`` (a piece waits while its last bytes may still be part of a longer character)."""

    def __init__(self, tokenizer, write: Callable[[str], None]) -> None:
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = 0
        self.skip_prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt:  # the first call carries the prompt
            self.skip_prompt = False
            return
        self.ids += value.reshape(-1).tolist()
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.write(text[self.shown:])
            self.shown = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids)
        if len(text) > self.shown:
            self.write(text[self.shown:])


def generate(lm: LoadedModel, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.8,
             top_p: float = 0.95, seed: int = 0, use_cache: bool = True,
             write: Callable[[str], None] | None = None) -> Generation:
    """Continue ``prompt``; ``write`` receives the text as it comes."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError(f"--temperature must be >= 0 and --top-p in (0, 1], got {temperature} and {top_p}")
    ids = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ConfigError("the prompt is empty (no tokens)")
    ctx = lm.context_length
    if len(ids) >= ctx:
        raise ConfigError(f"the prompt is {len(ids)} tokens; the model's context is {ctx} tokens, so at most "
                          f"{ctx - 1} may be given")
    if len(ids) + max_new_tokens > ctx:
        log.warning("generating %d tokens instead of %d: the prompt (%d tokens) and the new tokens must fit the "
                    "context of %d", ctx - len(ids), max_new_tokens, len(ids), ctx)
        max_new_tokens = ctx - len(ids)
    torch.manual_seed(seed)
    sample = temperature > 0
    kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p) if sample else dict(do_sample=False)
    eos = lm.tokenizer.eos_token_id
    t0 = time.perf_counter()
    with torch.no_grad():
        out = lm.model.generate(torch.tensor([ids], device=lm.device), max_new_tokens=max_new_tokens,
                                use_cache=use_cache, eos_token_id=eos, pad_token_id=eos,
                                streamer=_Stream(lm.tokenizer, write) if write else None, **kwargs)
    seconds = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    return Generation(prompt_ids=ids, new_ids=new, text=lm.tokenizer.decode(new), seconds=seconds)
