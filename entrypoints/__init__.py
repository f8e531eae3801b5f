"""Driving side: the CLI, the Litestar app, the client launchers and logging setup."""
