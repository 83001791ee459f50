"""qv's version, in a module that imports nothing (so any module may read it without an import circle)."""

__version__ = "0.1.0"
