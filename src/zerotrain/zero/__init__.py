"""Flat buffers and one Strategy per ZeRO stage."""
