"""Several peers per stage (replicas): the parts that do not depend on the peer runtime.

* :mod:`.averaging` — members-only averaging among a stage's replicas through hivemind's
  ``DecentralizedAverager`` (matchmaking, all-reduce and state download served to certified
  replicas of the stage only);
* :mod:`.exact_allreduce` — hivemind's all-reduce answering with averaged parts, so every replica
  ends with the same bytes;
* :mod:`.gradients` — a replica's step: its gradients averaged (weighted by its micro-batches) into
  the global batch's, with the replicas' parameter digests compared;
* :mod:`.state` — a stage's state as it travels to a joining replica (msgpack skeleton and
  tensors, checked against the receiver's own state) and its digest;
* :mod:`.errors` — what a round raises (importable without hivemind).

The step protocol's side (routing, the commit of a step, replicas that leave, which global
micro-batches each stage-0 replica feeds) is :mod:`mapl_swarm.step`'s.
"""
