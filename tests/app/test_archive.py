"""Unpacking uploaded adapter archives: what is accepted, what is refused and why, and
that a refused archive leaves nothing behind (hand-built hostile .zip and .tar.gz)."""

from __future__ import annotations

import hashlib
import io
import json
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.registry.archive import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    ArchiveError,
    content_digest,
    unpack_adapter,
)

CONFIG = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}).encode()
WEIGHTS = bytes(range(256)) * 64  # stands in for safetensors; the engine checks those
LIMIT = 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One archive member: a regular file unless `kind` says otherwise."""

    name: str
    data: bytes = b""
    kind: str = "file"  # file | dir | symlink | hardlink | chardev | blockdev | fifo
    target: str = ""  # links
    size: int | None = None  # a tar file member of this many zero bytes (bombs)
    pax: dict[str, str] | None = None


def adapter_entries(prefix: str = "") -> list[Entry]:
    return [Entry(prefix + CONFIG_FILE, CONFIG), Entry(prefix + WEIGHTS_FILE, WEIGHTS)]


class _Zeros(io.RawIOBase):
    """`size` zero bytes, produced as read (bombs without holding them in memory)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def write_tar_gz(path: Path, entries: list[Entry]) -> Path:
    types = {
        "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
        "hardlink": tarfile.LNKTYPE, "chardev": tarfile.CHRTYPE, "blockdev": tarfile.BLKTYPE,
        "fifo": tarfile.FIFOTYPE,
    }
    with tarfile.open(path, "w:gz", compresslevel=1, format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = types[e.kind]
            info.linkname = e.target
            info.mode = 0o755 if e.kind == "dir" else 0o644
            if e.pax:
                info.pax_headers = dict(e.pax)
            if e.kind == "file":
                info.size = len(e.data) if e.size is None else e.size
                source = io.BytesIO(e.data) if e.size is None else io.BufferedReader(_Zeros(e.size))
                tf.addfile(info, source)
            else:
                tf.addfile(info)
    return path


def write_zip(path: Path, entries: list[Entry]) -> Path:
    modes = {
        "file": stat.S_IFREG | 0o644, "dir": stat.S_IFDIR | 0o755,
        "symlink": stat.S_IFLNK | 0o777, "fifo": stat.S_IFIFO | 0o644,
        "chardev": stat.S_IFCHR | 0o644,
    }
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for e in entries:
            info = zipfile.ZipInfo(e.name + ("/" if e.kind == "dir" else ""))
            info.create_system = 3  # unix: external_attr carries the mode
            info.external_attr = modes[e.kind] << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            if e.size is not None:
                with zf.open(info, "w", force_zip64=True) as out:
                    chunk = bytes(1024 * 1024)
                    for _ in range(e.size // len(chunk)):
                        out.write(chunk)
            else:
                zf.writestr(info, e.target.encode() if e.kind == "symlink" else e.data)
    return path


def write_archive(path: Path, kind: str, entries: list[Entry]) -> Path:
    if kind == "zip":
        return write_zip(path.with_suffix(".zip"), entries)
    return write_tar_gz(path.with_suffix(".tar.gz"), entries)


def expected_digest(config: bytes = CONFIG, weights: bytes = WEIGHTS) -> str:
    return content_digest(hashlib.sha256(config).hexdigest(), hashlib.sha256(weights).hexdigest())


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    d = tmp_path / "staging"
    d.mkdir()
    return d


def refused(archive: Path, dest: Path, limit: int = LIMIT, **kwargs: int) -> ArchiveError:
    with pytest.raises(ArchiveError) as info:
        unpack_adapter(archive, dest, max_unpacked_bytes=limit, **kwargs)
    assert list(dest.iterdir()) == [], "a refused archive leaves nothing in the staging dir"
    return info.value


# ---------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
@pytest.mark.parametrize("prefix", ["", "my-adapter/", "./", "./my-adapter/"])
def test_unpacks_the_two_files_at_the_top_or_in_one_directory(
    tmp_path: Path, dest: Path, kind: str, prefix: str
) -> None:
    entries = [Entry(prefix.rstrip("/"), kind="dir")] if prefix.strip("./") else []
    entries += [*adapter_entries(prefix), Entry(prefix + "README.md", b"# my adapter\n")]
    archive = write_archive(tmp_path / "a", kind, entries)
    out = unpack_adapter(archive, dest, max_unpacked_bytes=LIMIT)
    assert out.directory.parent == dest
    assert sorted(p.name for p in out.directory.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert (out.directory / CONFIG_FILE).read_bytes() == CONFIG
    assert (out.directory / WEIGHTS_FILE).read_bytes() == WEIGHTS
    assert (out.config_bytes, out.weights_bytes) == (len(CONFIG), len(WEIGHTS))
    assert out.size_bytes == len(CONFIG) + len(WEIGHTS)
    assert out.sha256 == expected_digest()


def test_digest_is_the_manifest_hash_and_ignores_format_order_and_docs(
    tmp_path: Path, dest: Path
) -> None:
    manifest = (
        f"adapter_config.json {hashlib.sha256(CONFIG).hexdigest()}\n"
        f"adapter_model.safetensors {hashlib.sha256(WEIGHTS).hexdigest()}\n"
    )
    assert expected_digest() == hashlib.sha256(manifest.encode()).hexdigest()
    zipped = write_zip(tmp_path / "a.zip", adapter_entries())
    tarred = write_tar_gz(
        tmp_path / "b.tar.gz",
        [Entry("d", kind="dir"), Entry("d/LICENSE", b"MIT"), *reversed(adapter_entries("d/"))],
    )
    changed = write_zip(tmp_path / "c.zip", [Entry(CONFIG_FILE, CONFIG + b" "),
                                              Entry(WEIGHTS_FILE, WEIGHTS)])
    digests = [unpack_adapter(a, dest, max_unpacked_bytes=LIMIT).sha256
               for a in (zipped, tarred, changed)]
    assert digests[0] == digests[1] == expected_digest()
    assert digests[2] == expected_digest(config=CONFIG + b" ")


def test_tokenizer_files_and_macos_metadata_are_skipped(tmp_path: Path, dest: Path) -> None:
    archive = write_zip(tmp_path / "a.zip", [
        *adapter_entries("x/"),
        Entry("x/tokenizer.json", b"{}"),
        Entry("x/special_tokens_map.json", b"{}"),
        Entry("x/notes.txt", b"hi"),
        Entry("__MACOSX/x/._adapter_config.json", b"junk"),
        Entry("x/.DS_Store", b"junk"),
    ])
    out = unpack_adapter(archive, dest, max_unpacked_bytes=LIMIT)
    assert sorted(p.name for p in out.directory.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]


# ---------------------------------------------------------------------------- refused

# (name, members, message fragment); each is tried as .zip and as .tar.gz.
HOSTILE: list[tuple[str, list[Entry], str]] = [
    ("traversal", [*adapter_entries(), Entry("../evil.txt", b"x")], "'..' path component"),
    ("deep-traversal", [Entry("a/../../../../evil.txt", b"x"), *adapter_entries()],
     "'..' path component"),
    ("traversal-named-config", [Entry("../adapter_config.json", CONFIG),
                                Entry(WEIGHTS_FILE, WEIGHTS)], "'..' path component"),
    ("absolute", [Entry("/tmp/adapter_config.json", CONFIG), Entry(WEIGHTS_FILE, WEIGHTS)],
     "absolute path"),
    ("drive-letter", [Entry("C:/adapter_config.json", CONFIG), Entry(WEIGHTS_FILE, WEIGHTS)],
     "absolute path"),
    ("backslash", [Entry("..\\evil.txt", b"x"), *adapter_entries()], "invalid name"),
    ("symlink", [Entry(CONFIG_FILE, kind="symlink", target="/etc/passwd"),
                 Entry(WEIGHTS_FILE, WEIGHTS)], "is a symbolic link"),
    ("symlink-extra", [*adapter_entries(), Entry("README.md", kind="symlink", target="/")],
     "is a symbolic link"),
    ("fifo", [*adapter_entries(), Entry("pipe", kind="fifo")], "FIFO"),
    ("chardev", [*adapter_entries(), Entry("null", kind="chardev")], "is a device"),
    ("pickle-weights", [Entry(CONFIG_FILE, CONFIG), Entry("adapter_model.bin", WEIGHTS)],
     "pickle file"),
    ("pickle-extra", [*adapter_entries(), Entry("training_args.bin", b"\x80\x04.")],
     "pickle file"),
    ("pickle-pt", [*adapter_entries(), Entry("adapter.pt", b"\x80\x04.")], "pickle file"),
    ("missing-config", [Entry(WEIGHTS_FILE, WEIGHTS), Entry("README.md", b"hi")],
     "has no adapter_config.json"),
    ("missing-weights", [Entry(CONFIG_FILE, CONFIG)], "has no adapter_model.safetensors"),
    ("unknown-file", [*adapter_entries(), Entry("run.py", b"import os")],
     "Unexpected archive member 'run.py'"),
    ("nested-file", [Entry(f"a/b/{CONFIG_FILE}", CONFIG), Entry(f"a/b/{WEIGHTS_FILE}", WEIGHTS)],
     "nested too deep"),
    ("two-dirs", [Entry(f"a/{CONFIG_FILE}", CONFIG), Entry(f"b/{WEIGHTS_FILE}", WEIGHTS)],
     "several directories"),
    ("duplicate", [*adapter_entries(), Entry(f"./{CONFIG_FILE}", CONFIG)],
     "holds adapter_config.json twice"),
    ("huge-config", [Entry(CONFIG_FILE, b" " * (MAX_CONFIG_BYTES + 1)),
                     Entry(WEIGHTS_FILE, WEIGHTS)], "larger than"),
]


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
@pytest.mark.parametrize(("case", "entries", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_members_are_refused_with_a_reason(
    tmp_path: Path, dest: Path, kind: str, case: str, entries: list[Entry], message: str
) -> None:
    archive = write_archive(tmp_path / "a", kind, entries)
    error = refused(archive, dest, limit=4 * MAX_CONFIG_BYTES)
    assert message in error.message
    assert (error.status_code, error.code) == (400, "invalid_archive")
    assert not (tmp_path / "evil.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["staging", archive.name])


@pytest.mark.parametrize("kind", ["hardlink", "blockdev"])
def test_tar_hard_links_and_block_devices_are_refused(
    tmp_path: Path, dest: Path, kind: str
) -> None:
    entries = [Entry(CONFIG_FILE, CONFIG), Entry(WEIGHTS_FILE, kind=kind, target=CONFIG_FILE)]
    error = refused(write_tar_gz(tmp_path / "a.tar.gz", entries), dest)
    assert ("hard link" if kind == "hardlink" else "is a device") in error.message


def test_too_many_members_are_refused(tmp_path: Path, dest: Path) -> None:
    docs = [Entry(f"doc{i}.md", b"x") for i in range(10)]
    for kind in ("zip", "tar.gz"):
        archive = write_archive(tmp_path / "a", kind, [*adapter_entries(), *docs])
        error = refused(archive, dest, max_members=8)
        assert "more than 8" in error.message


def test_not_an_archive_and_damaged_archives_are_refused(tmp_path: Path, dest: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"just some bytes")
    assert "neither a .zip nor a .tar.gz" in refused(plain, dest).message
    good = write_tar_gz(tmp_path / "good.tar.gz", adapter_entries()).read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good[: len(good) // 2])
    assert "damaged" in refused(cut, dest).message
    zipped = write_zip(tmp_path / "good.zip", adapter_entries()).read_bytes()
    cut_zip = tmp_path / "cut.zip"
    cut_zip.write_bytes(zipped[: len(zipped) - 30])
    assert "damaged" in refused(cut_zip, dest).message


# ---------------------------------------------------------------------------- bombs


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_a_decompression_bomb_is_refused_while_unpacking(
    tmp_path: Path, dest: Path, kind: str
) -> None:
    # 64 MiB of zeros packs into ~100 KiB; the limit is 1 MiB.
    bomb = [Entry(CONFIG_FILE, CONFIG), Entry(WEIGHTS_FILE, size=64 * 1024 * 1024)]
    archive = write_archive(tmp_path / "bomb", kind, bomb)
    assert archive.stat().st_size < 1024 * 1024
    error = refused(archive, dest)
    assert (error.status_code, error.code) == (413, "archive_too_large")
    assert "decompression bomb" in error.message


def test_a_bomb_in_a_skipped_member_is_bounded_too(tmp_path: Path, dest: Path) -> None:
    bomb = [*adapter_entries(), Entry("README.md", size=64 * 1024 * 1024)]
    error = refused(write_tar_gz(tmp_path / "bomb.tar.gz", bomb), dest)
    assert error.status_code == 413


def test_a_bomb_in_a_pax_header_is_bounded(tmp_path: Path, dest: Path) -> None:
    # tarfile reads extended headers into memory by itself: the stream's count bounds it.
    bomb = [Entry(CONFIG_FILE, CONFIG, pax={"comment": "x" * (8 * LIMIT)}),
            Entry(WEIGHTS_FILE, WEIGHTS)]
    error = refused(write_tar_gz(tmp_path / "pax.tar.gz", bomb), dest)
    assert error.status_code == 413


def test_the_limit_counts_the_bytes_of_both_files(tmp_path: Path, dest: Path) -> None:
    weights = b"w" * 1000
    archive = write_zip(tmp_path / "a.zip", [Entry(CONFIG_FILE, CONFIG),
                                             Entry(WEIGHTS_FILE, weights)])
    exact = len(CONFIG) + len(weights)
    assert refused(archive, dest, limit=exact - 1).status_code == 413
    assert unpack_adapter(archive, dest, max_unpacked_bytes=exact).size_bytes == exact
