"""Alembic migrations of the service's database (`loraplex db upgrade`)."""
