"""This cleanroom's version: in records, provenance and the server's answers (the package's
``cleanroom.__version__`` is this one)."""

__version__ = "0.1.0"
