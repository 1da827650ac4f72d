# tq-redis image: the `tq-redis` CLI (storage nodes, status, demo) and the library for rank processes.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app

# CPU torch first (the default index would pull a multi-GB CUDA build); swap the index for GPU images.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY tq_redis ./tq_redis
COPY lua ./lua
COPY backends ./backends
COPY examples ./examples
RUN pip install .

ENTRYPOINT []
CMD ["tq-redis", "--help"]
