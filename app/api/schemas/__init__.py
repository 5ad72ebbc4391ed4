"""Request and response bodies of the admin and tenant APIs (pydantic)."""
