"""Shared fixtures. Model checkpoints and services each live in their own plugin module."""

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_services"]
