"""Reference models."""
