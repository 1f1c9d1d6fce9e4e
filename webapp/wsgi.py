"""WSGI entry point: `gunicorn webapp.wsgi:app` (settings from LLMQ_* variables)."""

from __future__ import annotations

import logging
import os

from webapp import create_app

logging.basicConfig(level=os.environ.get("LLMQ_LOG_LEVEL", "INFO"),
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
app = create_app()
