"""A real S3-compatible server for the tests: moto's standalone server (`moto_server`) in a
subprocess on a free loopback port, spoken to over HTTP by boto3 as any S3 store would
be. Its buckets live in its memory, so a TcpProxy in front of it (tests/utils/tcp_proxy.py)
is how a test takes the store away and gives it back with its contents."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.utils.processes import free_port, log_tail

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_server(log_dir: Path) -> Iterator[str]:
    """The server's endpoint URL while the context lasts; killed at its end."""
    port = free_port()
    log_path = log_dir / "moto.log"
    executable = Path(sys.executable).with_name("moto_server")
    with log_path.open("ab") as log:
        proc = subprocess.Popen([str(executable), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto_server did not start:\n{log_tail(log_path)}"
                    ) from None
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()


def s3_env(endpoint_url: str) -> dict[str, str]:
    """The environment a loraplex process needs to reach the store at endpoint_url."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint_url}


def s3_client(endpoint_url: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@contextmanager
def aws_environment(endpoint_url: str) -> Iterator[None]:
    """This process's AWS settings pointed at endpoint_url (restored on exit)."""
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(s3_env(endpoint_url))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
