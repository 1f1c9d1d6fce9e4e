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

RUN useradd --create-home llmq && mkdir -p /models && chown llmq /models
USER llmq
EXPOSE 8000
CMD ["llmq", "--help"]
