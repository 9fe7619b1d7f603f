"""mxrefit: move freshly trained weights into a running inference engine, fast and bit-exact."""

__version__ = "0.1.0"
