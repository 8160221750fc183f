"""leanimg: lean VM memory images (format v1.1: spec/format.md)."""

__version__ = "0.1.0"
