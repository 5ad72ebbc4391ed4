"""App settings: one pydantic-settings class, read from the environment (LORAPLEX_*)."""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The quota limiter's Redis timeout (app/quotas/redis_limiter.py takes its default here).
DEFAULT_QUOTA_REDIS_TIMEOUT_S = 0.5

# Keys that must never guard a production deployment.
_WEAK_ADMIN_KEYS = frozenset({"", "changeme", "change-me", "admin", "secret", "password"})
_MIN_ADMIN_KEY_CHARS = 16
_MIN_SECRET_CHARS = 32


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class AdapterStoreSettings(BaseSettings):
    """Where adapter files live; gateways, servers and workers read it alike (their
    settings extend it, and its environment prefix)."""

    model_config = SettingsConfigDict(
        env_prefix="LORAPLEX_", populate_by_name=True, extra="ignore"
    )

    data_dir: Path = Path("./var")
    # Where adapter files live: "" for <data_dir>/adapters (the embedded store; replicas
    # share it by sharing the data directory), or s3://bucket/prefix for an S3-compatible
    # object store (AWS credentials chain, AWS_ENDPOINT_URL for MinIO / R2 / GCS). With an
    # object store, <data_dir>/adapters is each node's cache of it, kept under
    # adapter_cache_bytes (least recently used first; adapters the engine serves stay).
    adapter_store: str = ""
    adapter_cache_bytes: int = Field(default=20 * 1024**3, ge=0)

    @model_validator(mode="after")
    def _check_adapter_store(self) -> AdapterStoreSettings:
        if self.adapter_store and not re.fullmatch(r"s3://[^/\s]+(/\S*)?", self.adapter_store):
            raise ValueError(
                f"LORAPLEX_ADAPTER_STORE={self.adapter_store!r}: expected s3://bucket[/prefix], "
                "or empty for the data directory"
            )
        return self


class Settings(AdapterStoreSettings):
    environment: Literal["development", "production"] = "development"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    no_auth: bool = False
    # Bootstrap key of the admin API.
    admin_key: str | None = None

    # Keys are stored as HMAC-SHA256 with this secret. Development: generated once and
    # kept in <data_dir>/secret_key; production: must be set (LORAPLEX_SECRET_KEY).
    secret_key: str | None = None

    # The tenant registry and the shared limits; read without the prefix.
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

    # Replicas pick up key revocations and tenant or adapter changes this often.
    refresh_interval_s: float = Field(default=0.5, gt=0, le=10)
    # When Redis fails: "open" admits within per-process limits (and counts it in a
    # metric), "closed" answers 503.
    quota_failure_mode: Literal["open", "closed"] = "open"
    # A Redis command (or connect, or wait for a pooled connection) that takes longer
    # counts as a Redis failure: it bounds what a hung Redis adds to a request.
    quota_redis_timeout_s: float = Field(default=DEFAULT_QUOTA_REDIS_TIMEOUT_S, gt=0, le=30)
    # A concurrency lease expires this long after its last renewal (a crashed request's
    # slot comes back by itself); running requests renew theirs every third of it.
    lease_ttl_s: float = Field(default=30.0, gt=0)
    # Usage records: written in batches of up to this many, at least this often.
    usage_batch_size: int = Field(default=500, ge=1)
    usage_flush_interval_s: float = Field(default=0.25, gt=0)
    # While other tenants' requests wait, one tenant may hold at most this share of the
    # KV cache (the engine defers its further requests; alone, it may use it all).
    tenant_kv_share: float | None = Field(default=0.5, gt=0, le=1)
    # Adapter uploads (archives) may not be larger than this.
    max_upload_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024)
    # Directories on this machine that POST /v1/load_lora_adapter may import adapters from
    # (os.pathsep-separated); empty: loads from a path are refused.
    adapter_import_dirs: str = ""

    # `loraplex gateway`: the token of the workers' internal API (LORAPLEX_WORKER_TOKEN),
    # and how many workers one engine request may try before it fails.
    worker_token: str | None = None
    worker_attempts: int = Field(default=3, ge=1, le=10)
    # LORAPLEX_METRICS_TOKEN: when set, GET /metrics needs `Authorization: Bearer <it>`
    # (its series name tenants and adapters); unset, it is open to any scraper.
    metrics_token: str | None = None

    @property
    def import_roots(self) -> tuple[Path, ...]:
        return tuple(Path(p) for p in self.adapter_import_dirs.split(os.pathsep) if p.strip())

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
            secret = self.secret_key or ""
            if secret.lower() in _WEAK_ADMIN_KEYS or len(secret) < _MIN_SECRET_CHARS:
                raise ValueError(
                    "LORAPLEX_SECRET_KEY must be set to a random secret of at least "
                    f"{_MIN_SECRET_CHARS} characters in production"
                )
        return self

    def resolved_secret_key(self) -> str:
        """The configured secret, or (development only) one generated once under data_dir."""
        if self.secret_key:
            return self.secret_key
        assert self.environment == "development", "validated: production sets a secret"
        path = self.data_dir / "secret_key"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass  # another process made it first: use theirs
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_urlsafe(32))
        return path.read_text().strip()


class WorkerSettings(AdapterStoreSettings):
    """`loraplex worker`: one engine behind the internal API. Read from the same
    environment as Settings; a worker has no database, keys or tenants of its own. Its
    adapters are read from <data_dir>/adapters/ (the store gateways write to, or its cache
    of the object store)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8001, ge=0, le=65535)
    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("redis_url", "REDIS_URL")
    )
    # Gateways must send it as a Bearer token (LORAPLEX_WORKER_TOKEN).
    worker_token: str | None = None
    # On SIGTERM: how long in-flight requests may run before they are aborted.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # A heartbeat this often; gateways drop a worker whose last one is older than the TTL.
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    heartbeat_ttl_s: float = Field(default=3.0, gt=0)
    # The MIG profile of the slice this worker runs on (e.g. "3g.71gb"), for placement
    # and operators; LORAPLEX_MIG_PROFILE, as `loraplex plan` prints it.
    mig_profile: str | None = None

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                "heartbeat_ttl_s must be longer than heartbeat_interval_s (a few intervals)"
            )
        return self
