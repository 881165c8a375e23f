"""A stage's state as it travels between replicas: a msgpack skeleton and a list of tensors.

A joining replica downloads its stage's state (parameters, optimizer, projector versions,
codebooks, step, data cursor: whatever the stage's ``state_dict`` holds) from a live replica
(:meth:`~mapl_swarm.replicas.averaging.StageAverager.download_state`). hivemind sends a msgpack
metadata object and tensors in its own protobuf form, never pickle; :func:`flatten_state` splits a
nested state into those two and :func:`restore_like` rebuilds it only after checking it against
the receiver's own state: the same tree (keys, list lengths, kinds of value), every tensor of the
same dtype and shape, and finite; each tensor is rebuilt in the memory layout of the receiver's.
So a replica takes nothing from the network that its own model and optimizer could not hold; values themselves cannot be checked (a replica of the stage is
trusted with them, as with its gradients). :func:`state_digest` is what replicas compare to know
they hold the same parameters, and :func:`state_summary` what tells replicas on other kernels
apart from replicas that diverged.

Skeleton nodes are ``[tag, payload]`` lists: ``d`` a dict (a list of ``[key, node]`` pairs, keys
str or int, in order), ``l`` a list and ``u`` a tuple (lists of nodes), ``t`` a tensor (its index in
the tensor list) and ``v`` a plain value (None, bool, int, float, str or bytes).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from mapl_swarm.errors import MaplError

__all__ = ["StateMismatch", "flatten_state", "prime_optimizers", "restore_like", "state_digest", "state_summary"]

_PLAIN = (type(None), bool, int, float, str, bytes)


class StateMismatch(MaplError):
    """A received state that does not fit this replica's own (names where and how)."""


def flatten_state(state: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """``state`` as (skeleton, tensors): see the module docstring. Tensors are detached CPU copies'
    views (contiguous), in the order the skeleton meets them."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any, where: str) -> list[Any]:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().cpu().contiguous())
            return ["t", len(tensors) - 1]
        if isinstance(x, dict):
            for k in x:
                if type(k) not in (str, int):
                    raise TypeError(f"state key {k!r} at {where}: only str and int keys travel")
            return ["d", [[k, walk(v, f"{where}.{k}")] for k, v in x.items()]]
        if isinstance(x, (list, tuple)):
            return ["u" if isinstance(x, tuple) else "l", [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]]
        if type(x) in _PLAIN:
            return ["v", x]
        raise TypeError(f"state value at {where} is a {type(x).__name__}: only tensors, containers and plain values "
                        f"travel")

    return walk(state, "state"), tensors


def restore_like(skeleton: Any, tensors: Sequence[Any], like: Any) -> Any:
    """The state ``skeleton`` and ``tensors`` describe, when it has ``like``'s form (module docstring);
    else :class:`StateMismatch` naming the first difference. Every tensor must be used exactly once."""
    used: set[int] = set()

    def build(node: Any, ref: Any, where: str) -> Any:
        if not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)):
            raise StateMismatch(f"{where}: not a state node")
        tag, payload = node
        if isinstance(ref, torch.Tensor):
            if tag != "t" or type(payload) is not int or not 0 <= payload < len(tensors) or payload in used:
                raise StateMismatch(f"{where}: a tensor was expected")
            used.add(payload)
            t = tensors[payload]
            if not isinstance(t, torch.Tensor) or t.dtype != ref.dtype or t.shape != ref.shape:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise StateMismatch(f"{where}: {got}, this replica holds {ref.dtype} {tuple(ref.shape)}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise StateMismatch(f"{where}: not finite")
            # the receiver's memory layout too: a tensor travels contiguous, and the same values in
            # another layout (SPEL's momentum is laid out as its transposed projector) take other
            # matmul paths, so the replica would step to other bits
            return torch.empty_like(ref, device="cpu").copy_(t) if t.stride() != ref.stride() else t
        if isinstance(ref, dict):
            if tag != "d" or not isinstance(payload, list) or not all(isinstance(p, list) and len(p) == 2
                                                                      for p in payload):
                raise StateMismatch(f"{where}: a map was expected")
            keys = [p[0] for p in payload]
            if keys != list(ref):
                raise StateMismatch(f"{where}: keys {keys[:8]}, this replica's are {list(ref)[:8]}")
            return {k: build(n, ref[k], f"{where}.{k}") for k, n in payload}
        if isinstance(ref, (list, tuple)):
            want = "u" if isinstance(ref, tuple) else "l"
            if tag != want or not isinstance(payload, list) or len(payload) != len(ref):
                raise StateMismatch(f"{where}: a {type(ref).__name__} of {len(ref)} was expected")
            items = [build(n, r, f"{where}[{i}]") for i, (n, r) in enumerate(zip(payload, ref))]
            return tuple(items) if want == "u" else items
        if tag != "v" or type(payload) is not type(ref):
            raise StateMismatch(f"{where}: a {type(ref).__name__} was expected, got {type(payload).__name__}")
        if isinstance(payload, float) and not math.isfinite(payload):
            raise StateMismatch(f"{where}: not finite")
        return payload

    state = build(skeleton, like, "state")
    if len(used) != len(tensors):
        raise StateMismatch(f"{len(tensors) - len(used)} tensor(s) beyond what this replica's state holds")
    return state


def state_digest(state: Any) -> str:
    """SHA-256 (hex) of ``state``'s skeleton and every tensor's dtype, shape and bytes: equal for
    two replicas exactly when they hold the same state."""
    return state_summary(state)[0]


def state_summary(state: Any) -> tuple[str, str, list[float]]:
    """``state``'s digest (:func:`state_digest`), frame and sketch. The frame is SHA-256 (hex) of
    the skeleton, every tensor's dtype and shape and every non-floating tensor's bytes; the sketch,
    for each floating tensor in order, its sum and its sum of squares (float64). Replicas whose
    kernels round differently (another CPU instruction set, another GPU) step to other last bits:
    they hold the same frame and sketches within :data:`~mapl_swarm.step.rounds.SKETCH_TOLERANCE`."""
    skeleton, tensors = flatten_state(state)
    head = repr(skeleton).encode()
    digest, frame = hashlib.sha256(head), hashlib.sha256(head)
    sketch: list[float] = []
    for t in tensors:
        kind = f"{t.dtype}{tuple(t.shape)}".encode()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        digest.update(kind)
        digest.update(raw)
        frame.update(kind)
        if t.is_floating_point():
            x = t.to(torch.float64)
            sketch += [float(x.sum()), float(x.pow(2).sum())]
        else:
            frame.update(raw)
    return digest.hexdigest(), frame.hexdigest(), sketch


@torch.no_grad()
def prime_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Give fresh optimizers the state entries a stepped one holds (a joining replica's template for
    :func:`restore_like`): one step at learning rate 0 on zero gradients, which leaves every
    parameter as it was. The state is then replaced by the downloaded one."""
    for opt in optimizers:
        saved = [(g, g["lr"], g.get("weight_decay")) for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
            for q in g["params"]:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
        opt.step()
        for g, lr, wd in saved:
            g["lr"] = lr
            if wd is not None:
                g["weight_decay"] = wd
        opt.zero_grad(set_to_none=True)
