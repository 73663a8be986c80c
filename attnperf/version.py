"""The package's version, low enough for every module to read."""

__version__ = "0.1.0"
