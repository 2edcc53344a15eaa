"""Sharded, atomic checkpoints; consolidation and export."""
