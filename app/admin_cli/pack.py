"""A local PEFT adapter directory, checked, packed and sent as a streamed multipart form."""

from __future__ import annotations

import json
import tarfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from app.admin_cli.client import BadInput

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_CHUNK = 256 * 1024


def check_adapter_dir(directory: Path) -> None:
    """What can be known without the server: both files there, the config a JSON object.

    NOTE: the weights are not opened here: the server's validation reads them against
    the base model and says exactly what is wrong (rank, modules, shapes, a bad header).
    """
    if not directory.is_dir():
        raise BadInput(f"{directory} is not a directory.")
    missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
    if missing:
        raise BadInput(
            f"{directory} is not a PEFT adapter directory: {' and '.join(missing)} "
            f"missing (it needs {CONFIG_FILE} and {WEIGHTS_FILE}, as "
            "`save_pretrained` writes them)."
        )
    config_path = directory / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{config_path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise BadInput(f"{config_path} must hold a JSON object.")


def pack_adapter(directory: Path, dest: Path) -> Path:
    """A .tar.gz of the two PEFT files only (no checkpoints, no tokenizer, no README)."""
    archive = dest / "adapter.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ADAPTER_FILES:
            tar.add(directory / name, arcname=f"adapter/{name}", recursive=False)
    return archive


@dataclass(frozen=True, slots=True)
class MultipartUpload:
    """A multipart/form-data body of text fields and one file, produced in chunks.

    NOTE: built by hand rather than with httpx's `files=`, so that the sender knows the
    length up front (the server refuses oversized uploads from Content-Length before
    reading them) and can report progress as each chunk leaves.
    """

    fields: dict[str, str]
    file_field: str
    file_path: Path
    boundary: str

    @classmethod
    def of(cls, fields: dict[str, str], file_field: str, file_path: Path) -> MultipartUpload:
        return cls(fields, file_field, file_path, f"loraplex-{uuid.uuid4().hex}")

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    def _head(self) -> bytes:
        parts = [
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
            f"{value}\r\n"
            for name, value in self.fields.items()
        ]
        parts.append(
            f"--{self.boundary}\r\nContent-Disposition: form-data; "
            f'name="{self.file_field}"; filename="{self.file_path.name}"\r\n'
            "Content-Type: application/gzip\r\n\r\n"
        )
        return "".join(parts).encode()

    def _tail(self) -> bytes:
        return f"\r\n--{self.boundary}--\r\n".encode()

    @property
    def length(self) -> int:
        return len(self._head()) + self.file_path.stat().st_size + len(self._tail())

    def chunks(self, on_sent: Callable[[int], None] | None = None) -> Iterator[bytes]:
        """The body; on_sent(n) after each chunk of n bytes is handed to the transport."""
        head = self._head()
        yield head
        if on_sent is not None:
            on_sent(len(head))
        with self.file_path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk
                if on_sent is not None:
                    on_sent(len(chunk))
        tail = self._tail()
        yield tail
        if on_sent is not None:
            on_sent(len(tail))
