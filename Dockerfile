# tq-redis image: the `tq-redis` CLI (storage nodes, status) and the library for rank processes.
# Extras (README "Installing") with --build-arg EXTRAS=demo,s3: `tq-redis demo` needs demo, a
# storage node's --spill or the fsspec store needs s3; a rank or storage node needs none.
FROM python:3.11-slim
ARG EXTRAS=

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app

# CPU torch first (the default index would pull a multi-GB CUDA build); swap the index for GPU images.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml setup.py README.md ./
COPY tq_redis ./tq_redis
COPY examples ./examples
# gcc only for the build: it compiles tq_redis.codec._copy and tq_redis.codec._scan, the data plane's native modules
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install ".${EXTRAS:+[$EXTRAS]}" \
    && python -c "import tq_redis.codec.fastcopy as f; assert f.NATIVE, 'tq_redis.codec._copy did not build'" \
    && python -c "import tq_redis.codec.batchscan as b; assert b.NATIVE, 'tq_redis.codec._scan did not build'" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

ENTRYPOINT []
CMD ["tq-redis", "--help"]
