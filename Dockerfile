# One image for every llmq process: web, worker, beat, migrations.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# torch first, as its own layer: the CPU build is pinned (CUDA and Ascend images swap this
# layer, see README "Accelerators").
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# a C compiler: workers build the native CPU kernel for their CPU at start-up
# (kernels/native.py; without one they keep torch's paths)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md ./
COPY llmq llmq
COPY webapp webapp
COPY tasks tasks
COPY workers workers
COPY kvcache kvcache
COPY kernels kernels
COPY migrations migrations
RUN pip install .

# ~/.cache/llmq: the native kernel a worker builds and its start-up timings (keyed by the
# CPU, the code and the model; kernels/native.py, workers/engine/startup_timings.py).
# Created here, owned by llmq, so the named volume docker-compose mounts on it starts out
# writable and a recreated worker reuses them instead of building and timing again.
RUN useradd --create-home llmq && mkdir -p /models /home/llmq/.cache/llmq \
    && chown llmq /models && chown -R llmq /home/llmq/.cache
USER llmq
EXPOSE 8000
CMD ["llmq", "--help"]
