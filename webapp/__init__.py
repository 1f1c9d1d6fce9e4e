"""The llmq web API (Flask). Build it with `create_app(settings)`; `webapp.wsgi` serves it."""

from __future__ import annotations

import logging

from flask import Flask

from tasks.settings import Settings

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> Flask:
    """The API app for `settings` (default: `Settings.from_env()`). Connects to nothing yet."""
    from webapp import (
        batch_validation,
        batches,
        dashboard,
        errors,
        events,
        files,
        jobs,
        meta,
        metrics,
        openai_api,
        openapi,
        request_id,
        tokens,
    )
    from webapp.responses import bp as responses_bp
    from webapp.services import Services

    settings = settings if settings is not None else Settings.from_env()
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep our field order
    svc = Services.build(settings)
    svc.init_app(app)
    batch_validation.init_app(app, svc)
    errors.register_error_handlers(app)
    request_id.init_app(app)
    app.register_blueprint(jobs.bp)
    app.register_blueprint(events.bp)
    app.register_blueprint(meta.bp)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(tokens.bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(files.bp)
    app.register_blueprint(batches.bp)
    app.register_blueprint(metrics.bp)
    app.register_blueprint(dashboard.bp)
    app.register_blueprint(openapi.bp)
    logger.info("llmq API ready: models %s, auth %s", sorted(settings.models),
                "on" if settings.auth_enabled else "off")
    return app
