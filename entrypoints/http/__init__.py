"""The Litestar app: one router per dialect, admin and dashboard routes."""
