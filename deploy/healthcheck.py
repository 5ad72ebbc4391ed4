#!/usr/bin/env python3
"""Container health check: exit 0 when GET http://127.0.0.1:PORT/PATH answers 2xx.

    loraplex-healthcheck [--port PORT] [--path /health] [--timeout 4]

PORT defaults to $LORAPLEX_PORT, else 8000 (the gateway). Standard library only: it
runs inside the image with nothing else installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request


def check(port: int, path: str, timeout_s: float) -> tuple[bool, str]:
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"
    return 200 <= status < 300, f"{url}: HTTP {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loraplex-healthcheck")
    parser.add_argument("--port", type=int, default=int(os.environ.get("LORAPLEX_PORT", "8000")))
    parser.add_argument("--path", default="/health")
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args(argv)
    ok, detail = check(args.port, args.path, args.timeout)
    print(detail, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
