"""attnctl: see what one multi-head attention layer does, in the terminal."""

__version__ = "0.1.0"
