"""The one thing pyproject.toml cannot say: leanimg._native (lean-image/_native.c: page digests
and INDEX_LIST parsing in C, without the GIL) is optional. Where gcc, Python's headers or
xxhash.h (Debian: gcc, python3-dev, libxxhash-dev) are missing it is not built and leanimg uses
the xxhash module and numpy instead: the same results, more slowly."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("leanimg._native", ["lean-image/_native.c"], optional=True)])
