"""App settings: one pydantic-settings class, read from the environment (LORAPLEX_*)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Keys that must never guard a production deployment.
_WEAK_ADMIN_KEYS = frozenset({"", "changeme", "change-me", "admin", "secret", "password"})
_MIN_ADMIN_KEY_CHARS = 16


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LORAPLEX_", populate_by_name=True, extra="ignore"
    )

    environment: Literal["development", "production"] = "development"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    no_auth: bool = False
    data_dir: Path = Path("./var")
    # Bootstrap key of the admin API.
    admin_key: str | None = None

    # Placeholders for the tenant registry and shared limits; read without the prefix.
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("database_url", "DATABASE_URL")
    )
    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("redis_url", "REDIS_URL")
    )

    # Adapters named on the command line (`--lora NAME=PATH`), shared by every tenant.
    preload_loras: dict[str, Path] = Field(default_factory=dict)

    # A whole non-streaming request, or a whole stream, may not take longer than this.
    request_timeout_s: float = Field(default=600.0, gt=0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # Above this many requests waiting in the engine, new ones get 503 + Retry-After.
    max_waiting_requests: int = Field(default=512, ge=1)
    retry_after_s: int = Field(default=2, ge=1)
    # On SIGTERM: how long in-flight requests may run before they are aborted.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # Stop strings are checked on every generated token; cap how many a request sends.
    max_stop_sequences: int = Field(default=16, ge=1)

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'loraplex.db'}"

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.no_auth and not is_loopback_host(self.host):
            raise ValueError(
                f"no_auth serves without API keys and is only allowed on a loopback "
                f"address (127.0.0.1, ::1, localhost), not {self.host!r}"
            )
        if self.environment == "production":
            key = self.admin_key or ""
            if key.lower() in _WEAK_ADMIN_KEYS or len(key) < _MIN_ADMIN_KEY_CHARS:
                raise ValueError(
                    "LORAPLEX_ADMIN_KEY must be set to a random secret of at least "
                    f"{_MIN_ADMIN_KEY_CHARS} characters in production"
                )
        return self
