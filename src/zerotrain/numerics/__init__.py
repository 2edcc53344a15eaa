"""Float formats, loss scaling, precision policy."""
