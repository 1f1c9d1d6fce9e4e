"""Alembic migrations of the llmq database (run with `llmq db upgrade`)."""
