"""The package's version, in a leaf: the image tag and the generated files read it without the package root."""

__version__ = "0.1.0"
