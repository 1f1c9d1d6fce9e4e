"""WSGI entry point: `gunicorn webapp.wsgi:app` (settings from LLMQ_* variables).

Imported by each gunicorn worker process (no `--preload`): every process reads the
configured models' tokenizers here, before it serves its first request."""

from __future__ import annotations

import logging
import os

from webapp import create_app
from webapp.services import services

logging.basicConfig(level=os.environ.get("LLMQ_LOG_LEVEL", "INFO"),
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
app = create_app()
with app.app_context():
    services().models.preload()
