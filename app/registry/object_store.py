"""Adapter files in an S3-compatible object store (`LORAPLEX_ADAPTER_STORE=s3://bucket/prefix`):
AWS S3, MinIO, Cloudflare R2, GCS's XML API, Ceph. Every node keeps the local store
(store.py) as its cache of what it fetched from here.

Layout: `<prefix>/<sha256>/adapter_config.json` and `<prefix>/<sha256>/adapter_model.safetensors`,
the two files of the local store, under the content address of archive.content_digest;
every download is hashed while it is written and refused unless it matches its address.
Files go up and down streamed from and to disk (boto3's managed transfers, multipart past
8 MiB), never whole in memory.

Credentials and endpoint come from boto3's standard chain: `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, web identity (IRSA) or instance roles, and
`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`) for stores other than AWS.

Imports (`s3://bucket/path/`) read any prefix the credentials can list: its objects are
downloaded as the members of a directory, which the registry then checks as any upload.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from app.registry.archive import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE, content_digest

_DIGEST = re.compile(r"[0-9a-f]{64}")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_CHUNK = 1024 * 1024


class StoreUnavailable(Exception):
    """The object store could not be reached, or refused the call; retry later."""


class BlobMissing(Exception):
    """No such adapter files in the object store."""


class BlobCorrupt(Exception):
    """Downloaded bytes that do not hash to their address: never served."""


@dataclass(frozen=True, slots=True)
class S3Url:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Url:
        """`s3://bucket` or `s3://bucket/some/prefix[/]`; ValueError otherwise."""
        if not url.startswith("s3://"):
            raise ValueError(f"{url!r} is not an s3:// URL")
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name")
        if "\x00" in prefix or any(p in (".", "..") for p in prefix.split("/")):
            raise ValueError(f"{url!r}: the path may not hold '.', '..' or NUL")
        prefix = prefix.strip("/")
        return cls(bucket, f"{prefix}/" if prefix else "")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def make_client(*, connect_timeout_s: float = 5.0, read_timeout_s: float = 60.0) -> Any:
    """An S3 client from the standard AWS configuration chain; a few retries, and short
    timeouts so that an unreachable store is reported rather than waited on."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(
        connect_timeout=connect_timeout_s, read_timeout=read_timeout_s,
        retries={"max_attempts": 3, "mode": "standard"},
        # S3-compatible stores (MinIO, moto, Ceph) take path-style addressing too.
        s3={"addressing_style": "path"},
    ))



def _failure(exc: BaseException, what: str) -> Exception:
    """What a botocore error means for the caller: a missing key, or the store down."""
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound"):
            return BlobMissing(f"{what}: not in the object store")
        return StoreUnavailable(f"{what}: the object store refused it ({code or exc})")
    return StoreUnavailable(f"{what}: the object store is unreachable ({exc})")


def _store_errors() -> tuple[type[BaseException], ...]:
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError
    from urllib3.exceptions import HTTPError

    # NOTE: a connection lost while a body streams surfaces from urllib3 (or as a plain
    # ConnectionError / TimeoutError), not always wrapped by botocore.
    return (BotoCoreError, ClientError, Boto3Error, HTTPError, ConnectionError, TimeoutError)


class ObjectStore:
    """The adapter files under one s3:// prefix (see the module's docstring)."""

    def __init__(self, url: str, client: Any = None) -> None:
        self.url = S3Url.parse(url)
        self.client = client if client is not None else make_client()

    def _key(self, digest: str, name: str = "") -> str:
        assert _DIGEST.fullmatch(digest), f"not a sha256 digest: {digest!r}"
        return f"{self.url.prefix}{digest}/{name}"

    def upload(self, digest: str, directory: Path) -> None:
        """Store the two files of `directory` under `digest` (the weights first, so that
        the config's presence means both are there). Always written, never skipped: a
        second upload of the same content refreshes its time for orphan collection."""
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            try:
                self.client.upload_file(str(directory / name), self.url.bucket,
                                        self._key(digest, name))
            except _store_errors() as e:
                raise _failure(e, f"uploading {digest[:12]}") from None

    def has(self, digest: str) -> bool:
        try:
            self.client.head_object(Bucket=self.url.bucket, Key=self._key(digest, CONFIG_FILE))
        except _store_errors() as e:
            failure = _failure(e, f"looking up {digest[:12]}")
            if isinstance(failure, BlobMissing):
                return False
            raise failure from None
        return True

    def download(self, digest: str, dest: Path) -> None:
        """Write the two files of `digest` into the empty directory `dest`, hashing them
        on the way; BlobCorrupt (and `dest` emptied) unless they hash to `digest`."""
        digests: dict[str, str] = {}
        try:
            for name in ADAPTER_FILES:
                digests[name] = self._fetch(self._key(digest, name), dest / name,
                                            f"fetching {digest[:12]}")
            if content_digest(digests[CONFIG_FILE], digests[WEIGHTS_FILE]) != digest:
                raise BlobCorrupt(
                    f"the object store's files for {digest[:12]} do not hash to their "
                    "address: refused (re-upload the adapter)"
                )
        except BaseException:
            for name in ADAPTER_FILES:
                (dest / name).unlink(missing_ok=True)
            raise

    def _fetch(self, key: str, path: Path, what: str, *, bucket: str | None = None,
               max_bytes: int | None = None) -> str:
        """Stream one object to `path`; its sha256. TooBig past max_bytes."""
        try:
            body = self.client.get_object(Bucket=bucket or self.url.bucket, Key=key)["Body"]
        except _store_errors() as e:
            raise _failure(e, what) from None
        digest = hashlib.sha256()
        size = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                for chunk in body.iter_chunks(_CHUNK):
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise TooBig(max_bytes)
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        except _store_errors() as e:
            raise _failure(e, what) from None
        finally:
            body.close()
        return digest.hexdigest()

    def delete(self, digest: str) -> None:
        try:
            self.client.delete_objects(Bucket=self.url.bucket, Delete={"Objects": [
                {"Key": self._key(digest, name)} for name in ADAPTER_FILES
            ]})
        except _store_errors() as e:
            raise _failure(e, f"deleting {digest[:12]}") from None

    def digests(self) -> dict[str, datetime]:
        """Every digest with a file stored (an upload cut short included, for orphan
        collection), with the time its files were last written."""
        found: dict[str, datetime] = {}
        for obj in self._list(self.url.bucket, self.url.prefix, "listing the adapter store"):
            digest, _, name = obj["Key"].removeprefix(self.url.prefix).partition("/")
            if _DIGEST.fullmatch(digest) and name in ADAPTER_FILES:
                at = obj["LastModified"]
                found[digest] = max(found.get(digest, at), at)
        return found

    def _list(self, bucket: str, prefix: str, what: str) -> Iterator[dict[str, Any]]:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            )
            for page in pages:
                yield from page.get("Contents", [])
        except _store_errors() as e:
            raise _failure(e, what) from None

    def download_prefix(self, url: str, dest: Path, *, max_bytes: int, max_members: int
                        ) -> None:
        """The objects under `url` (an s3:// prefix, as a directory) downloaded into the
        empty directory `dest`. Object names become member names for the registry's
        checks (archive.py), which refuse what is nested, unknown or a pickle; more than
        max_members objects (TooMany) or max_bytes bytes (TooBig) are not read."""
        source = S3Url.parse(url)
        objects = [
            obj for obj in self._list(source.bucket, source.prefix, f"listing {source}")
            # "folder" markers that consoles create
            if not (obj["Key"].endswith("/") and not obj.get("Size"))
        ]
        if not objects:
            raise BlobMissing(f"nothing under {source}")
        if len(objects) > max_members:
            raise TooMany(max_members)
        total = 0
        for obj in objects:
            name = obj["Key"].removeprefix(source.prefix)
            total += int(obj.get("Size", 0))
            if total > max_bytes:
                raise TooBig(max_bytes)
            path = _member_path(dest, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fetch(obj["Key"], path, f"fetching {source}{name}", bucket=source.bucket,
                        max_bytes=max_bytes)


class TooBig(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} bytes")
        self.limit = limit


class TooMany(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} objects")
        self.limit = limit


def _member_path(root: Path, name: str) -> Path:
    """Where an imported object lands: its name's parts under `root`, none of them empty,
    '.', '..' or absolute (ValueError), so that no key leads out of `root`."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") or "\x00" in p
                                               for p in parts):
        raise ValueError(f"object name {name!r} under the import prefix is not a plain path")
    return root.joinpath(*parts)
