"""leanimg: lean VM memory images (format v1.0)."""

__version__ = "0.1.0"
