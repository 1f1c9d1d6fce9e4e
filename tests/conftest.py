"""Shared fixtures. Model checkpoints and services each live in their own plugin module."""

import os

# NOTE: the suite compares batched, served and offline outputs with solo and Hugging Face
# ones token for token, which only fp32 guarantees (bf16 rounds differently per batch
# shape). dtype="auto" would pick bf16 on a CPU with native bf16, so pin its meaning here,
# before anything loads a model: worker subprocesses inherit the variable, and the loader
# reads it for "auto" (tests of bf16 itself pass dtype="bfloat16").
os.environ["LLMQ_DTYPE"] = "float32"
# The same for the linear path: the start-up timing could pick another one in a worker
# subprocess than in the test process, and fp32 results differ in the last bits between them.
os.environ["LLMQ_LINEAR_PATH"] = "prepacked"

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_services"]
