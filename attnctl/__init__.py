"""attnctl: see what one multi-head attention layer does, in the terminal."""

__version__ = "0.1.0"

import warnings

# torch warns when it is imported without numpy; attnctl never uses numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
