"""The step protocol's pure core (SPEC §9.7, §9.10): no sockets, no event loop, no torch.

:class:`~.core.StepCore` is a peer's steps as a state machine fed events and returning intents
(:mod:`~.intents`); :class:`~mapl_swarm.peer.driver.Schedule` drives it over the network, a test's
simulated swarm drives it in memory. Its parts, one concern each: :mod:`~.flow` (serving a step),
:mod:`~.projector` (PROJ and PROJ_GRAD), :mod:`~.averaging` (the stage's rounds and downloads),
:mod:`~.repair` (replicas that leave), :mod:`~.redo` (a step's attempts), :mod:`~.commit` (the
commit and the REPORTs), :mod:`~.validation`, :mod:`~.members` (the stage's replicas),
:mod:`~.stopping` (leave and drain), :mod:`~.router`, :mod:`~.rounds` (an averaging round's
result), :mod:`~.state` (a step's books), :mod:`~.window` (what admission lets in), :mod:`~.actions`
(a chain's order of work) and :mod:`~.cadence` (when periodic work comes due).
"""
