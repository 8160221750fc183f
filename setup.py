"""The one thing pyproject.toml cannot say: leanimg._native (lean-image/_native.c: page digests,
DELTA_FRAME reads and INDEX_LIST parsing in C, without the GIL) is optional. Where gcc, Python's
headers, xxhash.h or libzstd (Debian: gcc, python3-dev, libxxhash-dev, libzstd-dev) are missing
it is not built and leanimg uses the xxhash and zstandard modules and numpy instead: the same
results, more slowly."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("leanimg._native", ["lean-image/_native.c"], libraries=["zstd"], optional=True)])
