"""Metrics: JSONL records and run manifests."""

from mapl_swarm.metrics.jsonl import JsonlWriter, run_manifest

__all__ = ["JsonlWriter", "run_manifest"]
