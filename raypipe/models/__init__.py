"""Model families as adapters over transformers classes (see `base.py`)."""

from raypipe.models.registry import vision_adapter

__all__ = ["vision_adapter"]
