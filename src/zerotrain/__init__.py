"""zerotrain: a legible LLM training framework (optimizers, formats, mixed precision, ZeRO)."""

__version__ = "0.1.0"

__all__ = ["__version__", "initialize"]


def initialize(model, config=None, **kwargs):
    """Wrap `model` in an Engine configured by `config` (a Config, dict or None for defaults)."""
    from zerotrain.engine import initialize as _initialize

    return _initialize(model, config, **kwargs)
