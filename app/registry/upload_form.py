"""A multipart/form-data upload streamed to a file: one file part and a few short text
fields, parsed as the body arrives, never held in memory, cut off at a size limit."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header

MAX_FIELD_BYTES = 1024
MAX_PARTS = 8
# Part headers, boundaries and the text fields around the file.
FORM_OVERHEAD_BYTES = 64 * 1024


class FormError(Exception):
    """The upload's form was refused (status 400, or 413 when too large)."""

    def __init__(
        self, message: str, *, status_code: int = 400, code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param


@dataclass(slots=True)
class UploadForm:
    fields: dict[str, str]
    file: Path  # where the file part was written
    filename: str | None
    file_bytes: int


def file_too_large(limit: int) -> FormError:
    return FormError(
        f"The upload is larger than the limit of {limit} bytes.",
        status_code=413,
        code="request_too_large",
    )


@dataclass(slots=True)
class _Part:
    header_name: bytes = b""
    header_value: bytes = b""
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str | None = None
    is_file: bool = False
    data: bytearray = field(default_factory=bytearray)


class _FormReader:
    def __init__(
        self, dest: Path, *, file_field: str, text_fields: frozenset[str], max_file_bytes: int,
        unknown_field_messages: dict[str, str],
    ) -> None:
        self.dest = dest
        self.file_field = file_field
        self.text_fields = text_fields
        self.max_file_bytes = max_file_bytes
        self.unknown_field_messages = unknown_field_messages
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_bytes = 0
        self.fd: int | None = None
        self.pending: list[bytes] = []  # file data parsed, not yet written
        self.num_parts = 0
        self.seen: set[str] = set()
        self.ended = False
        self.part = _Part()

    # python-multipart callbacks (synchronous; file data is written between chunks)

    def on_part_begin(self) -> None:
        self.num_parts += 1
        if self.num_parts > MAX_PARTS:
            raise FormError(f"The form has more than {MAX_PARTS} parts.")
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.part.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.part.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers[self.part.header_name.strip().lower()] = self.part.header_value.strip()
        self.part.header_name = self.part.header_value = b""

    def on_headers_finished(self) -> None:
        disposition, options = parse_options_header(self.part.headers.get(b"content-disposition"))
        raw_name = options.get(b"name")
        if disposition != b"form-data" or raw_name is None:
            raise FormError("Every part of the form needs Content-Disposition: form-data; name=.")
        name = raw_name.decode("utf-8", "replace")
        if name in self.seen:
            raise FormError(f"The form has the field '{name}' twice.", param=name)
        self.seen.add(name)
        self.part.name = name
        if name == self.file_field:
            self.part.is_file = True
            filename = options.get(b"filename")
            self.filename = None if filename is None else filename.decode("utf-8", "replace")
            self.fd = os.open(self.dest, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        elif name not in self.text_fields:
            message = self.unknown_field_messages.get(
                name,
                f"Unknown form field '{name}'; expected: "
                f"{', '.join(sorted({self.file_field, *self.text_fields}))}.",
            )
            raise FormError(message, param=name)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self.part.is_file:
            self.file_bytes += len(chunk)
            if self.file_bytes > self.max_file_bytes:
                raise file_too_large(self.max_file_bytes)
            self.pending.append(chunk)
            return
        self.part.data += chunk
        if len(self.part.data) > MAX_FIELD_BYTES:
            raise FormError(
                f"The form field '{self.part.name}' is longer than {MAX_FIELD_BYTES} bytes.",
                param=self.part.name,
            )

    def on_part_end(self) -> None:
        if self.part.is_file or self.part.name is None:
            return
        try:
            self.fields[self.part.name] = self.part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise FormError(
                f"The form field '{self.part.name}' is not UTF-8 text.", param=self.part.name
            ) from None

    def on_end(self) -> None:
        self.ended = True

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_end": self.on_end,
        }

    async def flush(self) -> None:
        if self.pending and self.fd is not None:
            data, self.pending = b"".join(self.pending), []
            await asyncio.to_thread(_write_all, self.fd, data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def read_upload_form(
    chunks: AsyncIterator[bytes],
    content_type: str | None,
    dest: Path,
    *,
    max_file_bytes: int,
    file_field: str = "file",
    text_fields: frozenset[str] = frozenset(),
    unknown_field_messages: dict[str, str] | None = None,
) -> UploadForm:
    """Parse a multipart body from `chunks`, writing the `file_field` part into `dest`
    (an existing file, truncated). Raises FormError for a malformed or oversized form
    (413 as soon as the file passes max_file_bytes: the rest of the body is not read)."""
    mime, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if mime != b"multipart/form-data" or not boundary:
        raise FormError("Send the upload as multipart/form-data (with a boundary).")
    reader = _FormReader(
        dest,
        file_field=file_field,
        text_fields=text_fields,
        max_file_bytes=max_file_bytes,
        unknown_field_messages=unknown_field_messages or {},
    )
    parser = MultipartParser(boundary, reader.callbacks())  # type: ignore[arg-type]
    max_body_bytes = max_file_bytes + FORM_OVERHEAD_BYTES
    body_bytes = 0
    try:
        async for chunk in chunks:
            body_bytes += len(chunk)
            if body_bytes > max_body_bytes:
                raise file_too_large(max_file_bytes)
            try:
                parser.write(chunk)
            except MultipartParseError as e:
                raise FormError(f"The multipart body is malformed: {e}") from e
            await reader.flush()
            if reader.ended:
                break
        with contextlib.suppress(MultipartParseError):
            parser.finalize()
        if not reader.ended:
            raise FormError("The multipart body ended before its closing boundary.")
    finally:
        reader.close()
    if file_field not in reader.seen:
        raise FormError(f"Missing required form field '{file_field}'.", param=file_field)
    return UploadForm(
        fields=reader.fields,
        file=dest,
        filename=reader.filename,
        file_bytes=reader.file_bytes,
    )
