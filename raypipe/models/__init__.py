"""Model families as adapters over transformers classes: `base.py` is the interface, `registry.py`
reads each family package's record."""
