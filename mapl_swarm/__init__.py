"""mapl_swarm: pipeline-parallel LLM training over slow links with MAPL compression."""

__version__ = "0.1.0"
