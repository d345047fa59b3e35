"""Offline batch inference over object storage on Ray Data (`raypipe batch`); see `job.py`."""

from raypipe.batch.job import BatchOptions, BatchSummary, run_batch

__all__ = ["BatchOptions", "BatchSummary", "run_batch"]
