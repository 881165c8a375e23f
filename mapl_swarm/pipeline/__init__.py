"""Stage runtime, in-process pipeline, checkpoints and the single-process trainer.

Submodules are imported directly (``mapl_swarm.pipeline.trainer``...) so that importing the
stage runtime does not pull in the data stack.
"""
