"""Build hook for the optional native modules; all other metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # optional: without a C compiler the install still succeeds and tq_redis.fastcopy uses Python loops
        Extension("tq_redis._copy", ["tq_redis/_copy.c"], optional=True, extra_compile_args=["-O2"]),
        # optional too: without it tq_redis.batchscan reads a batch's sizes and key hashes in Python
        Extension("tq_redis._scan", ["tq_redis/_scan.c"], optional=True, extra_compile_args=["-O2"]),
    ]
)
