"""Build hook for the optional native modules; all other metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # optional: without a C compiler the install still succeeds and tq_redis.codec.fastcopy uses Python loops
        Extension("tq_redis.codec._copy", ["tq_redis/codec/_copy.c"], optional=True, extra_compile_args=["-O2"]),
        # optional too: without it tq_redis.codec.batchscan reads a batch's sizes and key hashes in Python
        Extension("tq_redis.codec._scan", ["tq_redis/codec/_scan.c"], optional=True, extra_compile_args=["-O2"]),
    ]
)
