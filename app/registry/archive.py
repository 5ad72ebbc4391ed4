"""Unpacking an uploaded adapter archive (.zip or .tar.gz) without trusting any of it.

Nothing in the archive chooses where bytes go: only two fixed file names are ever
written, into a fresh directory. Links, devices, absolute or `..` paths, pickle files
and unknown files are refused rather than skipped, so that the uploader learns what is
wrong. Sizes are counted while decompressing; header sizes are never believed.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import stat
import struct
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# A PEFT directory holds two files, a README and a few tokenizer files at most.
MAX_MEMBERS = 64
MAX_CONFIG_BYTES = 1024 * 1024

# Next to an adapter, accepted and never unpacked: docs, and what trainers and the Hub
# save alongside (the base model's tokenizer is what the server uses).
_IGNORED_NAMES = frozenset({
    "LICENSE", "NOTICE", ".gitattributes", ".gitignore", ".DS_Store",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "added_tokens.json", "chat_template.jinja", "generation_config.json",
})
_IGNORED_SUFFIXES = (".md", ".txt", ".rst")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_MACOS_METADATA_DIR = "__MACOSX"  # resource forks Finder adds to zips
_DRIVE = re.compile(r"^[A-Za-z]:")
_CHUNK = 1024 * 1024
# A tar stream carries a 512-byte header and up to 511 bytes of padding per member,
# and is padded to 10 KiB records at the end.
_TAR_BYTES_PER_MEMBER = 1024
_TAR_TRAILER_BYTES = 2 * 10240


class ArchiveError(ValueError):
    """An archive refused; the message tells the uploader what to change."""

    def __init__(self, message: str, *, status_code: int = 400, code: str = "invalid_archive"):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code


@dataclass(frozen=True, slots=True)
class UnpackedAdapter:
    directory: Path  # holds exactly adapter_config.json and adapter_model.safetensors
    sha256: str  # content_digest() of the two files
    config_bytes: int
    weights_bytes: int

    @property
    def size_bytes(self) -> int:
        return self.config_bytes + self.weights_bytes


def content_digest(config_sha256: str, weights_sha256: str) -> str:
    """The adapter's content address: the sha256 (hex) of the UTF-8 manifest

        "adapter_config.json <sha256 of its bytes>\\n"
        "adapter_model.safetensors <sha256 of its bytes>\\n"

    (lowercase hex digests). Files are hashed as uploaded, byte for byte; the archive's
    format, member order, timestamps and leading directory do not change it.
    """
    manifest = f"{CONFIG_FILE} {config_sha256}\n{WEIGHTS_FILE} {weights_sha256}\n"
    return hashlib.sha256(manifest.encode()).hexdigest()


def too_large(limit: int) -> ArchiveError:
    return ArchiveError(
        f"The archive unpacks to more than {limit} bytes, more than any adapter this server "
        "can serve may weigh (every target module of every layer at the largest rank, in "
        "float32); it was refused as a possible decompression bomb.",
        status_code=413,
        code="archive_too_large",
    )


def unpack_adapter(
    archive: Path, dest_parent: Path, *, max_unpacked_bytes: int, max_members: int = MAX_MEMBERS
) -> UnpackedAdapter:
    """Check `archive` and write its two adapter files into a new directory under
    `dest_parent`; raises ArchiveError (and leaves nothing behind) when it is refused.
    `archive` may also be an adapter directory on this machine (an import), read with the
    same checks as an archive's members."""
    reader: Callable[[Path, _Writer, int], None]
    magic = b""
    if not archive.is_dir():
        with open(archive, "rb") as f:
            magic = f.read(4)
    if archive.is_dir():
        reader = _read_directory
    elif magic[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        reader = _read_zip
    elif magic[:2] == b"\x1f\x8b":
        reader = _read_tar_gz
    else:
        raise ArchiveError(
            "The file is neither a .zip nor a .tar.gz archive; upload the adapter directory "
            f"({CONFIG_FILE} and {WEIGHTS_FILE}) packed as one of those."
        )
    dest = Path(tempfile.mkdtemp(prefix="unpack-", dir=dest_parent))
    try:
        writer = _Writer(dest, max_unpacked_bytes)
        reader(archive, writer, max_members)
        return writer.finish()
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------- members


@dataclass(slots=True)
class _Writer:
    """Receives the archive's members in order; writes the two adapter files."""

    dest: Path
    limit: int
    written: int = 0
    prefix: str | None = None  # the leading directory ("" for none), from the first file
    digests: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def wants(self, name: str, is_dir: bool) -> str | None:
        """Check a member's path; the adapter file to unpack it into, or None to skip it."""
        parts = _path_parts(name)
        if not parts or parts[0] == _MACOS_METADATA_DIR or parts[-1].startswith("._"):
            return None
        if is_dir:
            if len(parts) > 1:
                raise ArchiveError(
                    f"Archive member {name!r} is a nested directory; put the adapter's files "
                    "at the top of the archive or in a single directory."
                )
            return None
        if len(parts) > 2:
            raise ArchiveError(
                f"Archive member {name!r} is nested too deep; put the adapter's files at the "
                "top of the archive or in a single directory."
            )
        prefix = parts[0] if len(parts) == 2 else ""
        if self.prefix is None:
            self.prefix = prefix
        elif prefix != self.prefix:
            raise ArchiveError(
                "The archive's files are spread over several directories; put the adapter's "
                "files at the top of the archive or in a single directory."
            )
        base = parts[-1]
        if base in ADAPTER_FILES:
            if base in self.digests:
                raise ArchiveError(f"The archive holds {base} twice.")
            return base
        if base.lower().endswith(_PICKLE_SUFFIXES):
            raise ArchiveError(
                f"Archive member {name!r} is a pickle file: weights are accepted only as "
                f"safetensors ({WEIGHTS_FILE}), and pickle files are never loaded. Re-save the "
                "adapter with safe_serialization=True and leave other pickles out."
            )
        if base in _IGNORED_NAMES or base.endswith(_IGNORED_SUFFIXES):
            return None
        raise ArchiveError(
            f"Unexpected archive member {name!r}: an adapter archive holds {CONFIG_FILE}, "
            f"{WEIGHTS_FILE} and, optionally, a README."
        )

    def write(self, base: str, source: IO[bytes]) -> None:
        digest = hashlib.sha256()
        size = 0
        fd = os.open(self.dest / base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            while chunk := source.read(_CHUNK):
                size += len(chunk)
                self.written += len(chunk)
                if base == CONFIG_FILE and size > MAX_CONFIG_BYTES:
                    raise ArchiveError(
                        f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes; it is not a "
                        "PEFT adapter config."
                    )
                if self.written > self.limit:
                    raise too_large(self.limit)
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        self.digests[base] = digest.hexdigest()
        self.sizes[base] = size

    def finish(self) -> UnpackedAdapter:
        for base in ADAPTER_FILES:
            if base not in self.digests:
                raise ArchiveError(
                    f"The archive has no {base}; an adapter archive holds {CONFIG_FILE} and "
                    f"{WEIGHTS_FILE}, at its top or in a single directory."
                )
        return UnpackedAdapter(
            directory=self.dest,
            sha256=content_digest(self.digests[CONFIG_FILE], self.digests[WEIGHTS_FILE]),
            config_bytes=self.sizes[CONFIG_FILE],
            weights_bytes=self.sizes[WEIGHTS_FILE],
        )


def _path_parts(name: str) -> list[str]:
    """A member name's components, refusing anything that could point outside."""
    if not name or "\x00" in name or "\\" in name:
        raise ArchiveError(f"Archive member {name!r} has an invalid name (empty, NUL or '\\').")
    if name.startswith("/") or _DRIVE.match(name):
        raise ArchiveError(f"Archive member {name!r} has an absolute path.")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"Archive member {name!r} has a '..' path component.")
    return parts


def _refuse_type(name: str, what: str) -> ArchiveError:
    return ArchiveError(
        f"Archive member {name!r} is {what}; only regular files and directories are accepted."
    )


# ---------------------------------------------------------------------------- zip


def _read_zip(archive: Path, writer: _Writer, max_members: int) -> None:
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = zf.infolist()
            if len(infos) > max_members:
                raise ArchiveError(
                    f"The archive has {len(infos)} members, more than {max_members}."
                )
            for info in infos:
                mode = info.external_attr >> 16
                kind = stat.S_IFMT(mode)
                if kind == stat.S_IFLNK:
                    raise _refuse_type(info.filename, "a symbolic link")
                if kind in (stat.S_IFCHR, stat.S_IFBLK):
                    raise _refuse_type(info.filename, "a device")
                if kind in (stat.S_IFIFO, stat.S_IFSOCK):
                    raise _refuse_type(info.filename, "a FIFO or socket")
                is_dir = info.is_dir() or kind == stat.S_IFDIR
                base = writer.wants(info.filename, is_dir)
                if base is None:
                    continue
                if info.flag_bits & 0x1:
                    raise ArchiveError(f"Archive member {info.filename!r} is encrypted.")
                # Refused early; the count while reading is what actually bounds it.
                if writer.written + info.file_size > writer.limit:
                    raise too_large(writer.limit)
                with zf.open(info) as source:
                    writer.write(base, source)
    except ArchiveError:
        raise
    # Damaged archives surface as any of these (ValueError: undecodable names, bad fields).
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError,
            NotImplementedError, ValueError, struct.error) as e:
        raise ArchiveError(f"The .zip archive is damaged or unsupported: {e}") from e


# ---------------------------------------------------------------------------- tar.gz


class _StreamTooLarge(Exception):
    # NOTE: not a ValueError: tarfile turns some of those into its own errors.
    pass


class _BoundedReader:
    """The decompressed tar stream, failing past `limit` bytes: also bounds what tarfile
    reads by itself (long-name and pax headers, members it skips)."""

    def __init__(self, raw: gzip.GzipFile, limit: int) -> None:
        self._raw = raw
        self._limit = limit
        self.read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._limit + 1 - self.read_bytes
        data = self._raw.read(max(0, min(size, self._limit + 1 - self.read_bytes)))
        self.read_bytes += len(data)
        if self.read_bytes > self._limit:
            raise _StreamTooLarge
        return data


@contextmanager
def _tar_stream(archive: Path, limit: int) -> Iterator[tarfile.TarFile]:
    with open(archive, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        bounded = _BoundedReader(gz, limit)
        # Stream mode ("r|"): members are read in order, nothing seeks back.
        with tarfile.open(fileobj=bounded, mode="r|") as tf:  # type: ignore[call-overload]
            yield tf


def _read_tar_gz(archive: Path, writer: _Writer, max_members: int) -> None:
    stream_limit = writer.limit + max_members * _TAR_BYTES_PER_MEMBER + _TAR_TRAILER_BYTES
    try:
        with _tar_stream(archive, stream_limit) as tf:
            for count, member in enumerate(tf, start=1):
                if count > max_members:
                    raise ArchiveError(f"The archive has more than {max_members} members.")
                if member.issym():
                    raise _refuse_type(member.name, "a symbolic link")
                if member.islnk():
                    raise _refuse_type(member.name, "a hard link")
                if member.ischr() or member.isblk():
                    raise _refuse_type(member.name, "a device")
                if member.isfifo():
                    raise _refuse_type(member.name, "a FIFO")
                if not member.isdir() and member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                    raise _refuse_type(member.name, f"of unsupported type {member.type!r}")
                base = writer.wants(member.name, member.isdir())
                if base is None:
                    continue
                if writer.written + member.size > writer.limit:
                    raise too_large(writer.limit)
                source = tf.extractfile(member)
                assert source is not None, "a regular member has data"
                writer.write(base, source)
    except _StreamTooLarge:
        raise too_large(writer.limit) from None
    except ArchiveError:
        raise
    except (tarfile.TarError, gzip.BadGzipFile, zlib.error, EOFError, ValueError) as e:
        raise ArchiveError(f"The .tar.gz archive is damaged or unsupported: {e}") from e


# ---------------------------------------------------------------------------- directory


def directory_digest(root: Path, max_bytes: int) -> str | None:
    """The content address (content_digest) an import of the adapter directory `root`
    would get, without copying it; None where its two files are not plain files at its top
    or weigh more than `max_bytes` (the import itself then says what is wrong)."""
    digests: dict[str, str] = {}
    for base in ADAPTER_FILES:
        try:
            fd = os.open(root / base, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1 or st.st_size > max_bytes:
                return None
            digest = hashlib.sha256()
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        digests[base] = digest.hexdigest()
    return content_digest(digests[CONFIG_FILE], digests[WEIGHTS_FILE])


def _read_directory(root: Path, writer: _Writer, max_members: int) -> None:
    """A directory's entries as an archive's members: every entry opened relative to its
    parent's descriptor without following a link, so that nothing swapped in meanwhile
    leads out of it; links of either kind, devices, FIFOs and sockets are refused."""
    seen = 0

    def walk(dir_fd: int, prefix: str) -> None:
        nonlocal seen
        for name in sorted(os.listdir(dir_fd)):
            seen += 1
            if seen > max_members:
                raise ArchiveError(f"The directory has more than {max_members} entries.")
            member = prefix + name
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _refuse_type(member, "a symbolic link")
            if stat.S_ISDIR(st.st_mode):
                writer.wants(member, is_dir=True)
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                try:
                    walk(fd, member + "/")
                finally:
                    os.close(fd)
                continue
            if not stat.S_ISREG(st.st_mode):
                raise _refuse_type(member, "a device, FIFO or socket")
            if st.st_nlink > 1:
                raise _refuse_type(member, "a hard link")
            base = writer.wants(member, is_dir=False)
            if base is None:
                continue
            if writer.written + st.st_size > writer.limit:
                raise too_large(writer.limit)
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as source:
                opened = os.fstat(fd)
                if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                    raise ArchiveError(f"{member!r} changed while it was read; import it again.")
                writer.write(base, source)

    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise ArchiveError(f"The directory cannot be read: {e.strerror}.") from None
    try:
        walk(root_fd, "")
    except OSError as e:
        raise ArchiveError(f"The directory cannot be read: {e.strerror}.") from None
    finally:
        os.close(root_fd)
