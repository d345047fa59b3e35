"""Encoder data parallelism: worker actors, the balancer and partitioner, the coordinator, the embedding cache."""
