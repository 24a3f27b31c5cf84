"""The containers ``torch.save`` writes: the zip archive (torch >= 1.6:
``<name>/data.pkl`` and one member ``<name>/data/<key>`` per storage) and the
legacy stream (``_use_new_zipfile_serialization=False``: pickles, then every
storage's bytes). Each storage becomes a byte range read on demand: a stored zip
member or a legacy record is read with pread, a compressed member streamed."""
from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from typing import Any, Dict, List, Optional, Set

from .._core import SafetensorError
from ._torch_pickle import UNTYPED, StorageRef, load_pickle

__all__ = ["Checkpoint", "open_torch_checkpoint", "check_members", "MAX_PICKLE_BYTES",
           "MAX_COMPRESSION_RATIO"]

MAX_PICKLE_BYTES = 1 << 30          # a data.pkl larger than this is not a state dict
MAX_COMPRESSION_RATIO = 100         # past it a compressed member is taken for a zip bomb
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
LOCAL_HEADER = struct.Struct("<4s22xHH")
PIECE_BYTES = 16 << 20


# What zipfile and its decompressors raise on a corrupt or unsupported member.
ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError,
              NotImplementedError, ValueError)


class ByteRange:
    """`size` bytes of the file open as `fd` from byte `start`, read with pread;
    `source` and `what` name them in errors."""

    def __init__(self, fd: int, start: int, size: int, source: str, what: str) -> None:
        self.fd, self.start, self.size = fd, start, size
        self.source, self.what = source, what

    def read_into(self, begin: int, out: memoryview) -> None:
        position, view = self.start + begin, out
        while len(view):
            got = os.preadv(self.fd, [view], position)
            if got <= 0:
                raise SafetensorError(f"{self.source}: the file ends at byte {position}, "
                                      f"inside {self.what} (was it truncated?)")
            view, position = view[got:], position + got


class CompressedMember:
    """A compressed zip member, decompressed as it is read. The stream stays open
    between reads, so that reading a tensor chunk after chunk decompresses each
    byte once; only a read that goes back starts again from the member's start."""

    def __init__(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> None:
        self.archive, self.info, self.size = archive, info, info.file_size
        self.source = source
        self._member: Any = None

    def read_into(self, begin: int, out: memoryview) -> None:
        try:
            self._read_into(begin, out)
        except ZIP_ERRORS as error:
            raise SafetensorError(f"{self.source}: member {self.info.filename!r} cannot be "
                                  f"read ({type(error).__name__}: {error})") from None

    def _read_into(self, begin: int, out: memoryview) -> None:
        if self._member is None or self._member.tell() > begin:
            if self._member is not None:
                self._member.close()
            self._member = self.archive.open(self.info)
        self._member.seek(begin)        # forward: decompresses only what lies between
        view = out
        while len(view):
            data = self._member.read(min(len(view), PIECE_BYTES))
            if not data:
                raise SafetensorError(f"{self.source}: member {self.info.filename!r} ends "
                                      f"at byte {self._member.tell()}, before the "
                                      f"{self.info.file_size} its entry declares")
            view[:len(data)] = data
            view = view[len(data):]

    def close(self) -> None:
        if self._member is not None:
            self._member.close()
            self._member = None


class Checkpoint:
    """An open torch checkpoint: `tree`, the unpickled object (TensorRefs as its
    tensors), and for each storage key its StorageRef and its bytes."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.tree: Any = None
        self.pickle_bytes = 0                # the size of the pickle that made `tree`
        self.big_endian = False
        self.storages: Dict[str, StorageRef] = {}
        self.ranges: Dict[str, Any] = {}
        self.untyped: Set[str] = set()       # keys first referenced as torch.UntypedStorage
        self._fd: Optional[int] = None
        self._archive: Optional[zipfile.ZipFile] = None

    def storage(self, key: str, code: str, numel: int) -> StorageRef:
        """The unpickler's callback: one StorageRef per key, refusing a key
        referenced as two dtypes or sizes."""
        known = self.storages.get(key)
        if known is None:
            known = self.storages[key] = StorageRef(key, code, numel)
            if code == UNTYPED:
                self.untyped.add(key)
        elif (known.code, known.numel) != (code, numel) and not (
                code == UNTYPED and known.nbytes == numel):
            raise SafetensorError(f"storage {key!r} is referenced as {numel} x {code} and as "
                                  f"{known.numel} x {known.code}")
        return known

    def check_storages(self) -> None:
        for key, ref in self.storages.items():
            found = self.ranges.get(key)
            if found is None:
                raise SafetensorError(f"{self.source}: storage {key!r} is not in the file")
            if ref.nbytes > found.size:
                raise SafetensorError(f"{self.source}: storage {key!r} holds {found.size} "
                                      f"bytes, {ref.nbytes} are referenced")

    def close(self) -> None:
        for found in self.ranges.values():
            if isinstance(found, CompressedMember):
                found.close()
        if self._archive is not None:
            self._archive.close()
            self._archive = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_torch_checkpoint(path: str) -> Checkpoint:
    """Read the pickle of the torch checkpoint at `path` (zip or legacy) without
    running any of its code; storages stay on disk until read."""
    source = os.fsdecode(path)
    checkpoint = Checkpoint(source)
    checkpoint._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if zipfile.is_zipfile(path):
            _read_zip(checkpoint, path)
        else:
            _read_legacy(checkpoint, path)
        checkpoint.check_storages()
    except BaseException:
        checkpoint.close()
        raise
    return checkpoint


def _read_zip(checkpoint: Checkpoint, path: str) -> None:
    source = checkpoint.source
    try:
        archive = checkpoint._archive = zipfile.ZipFile(path)
    except ZIP_ERRORS as error:
        raise SafetensorError(f"{source}: not a readable zip archive ({error})") from None
    infos = archive.infolist()
    names = [info.filename for info in infos]
    for name in names:
        parts = name.replace("\\", "/").split("/")
        if name.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
            raise SafetensorError(f"{source}: refusing the archive member {name!r}: its path "
                                  f"leaves the archive")
    if len(set(names)) != len(names):
        raise SafetensorError(f"{source}: the archive names a member twice")
    pickles = [name for name in names if name.count("/") == 1 and name.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise SafetensorError(f"{source}: not a torch checkpoint: expected one "
                              f"<name>/data.pkl, found {len(pickles)}")
    prefix = pickles[0][:-len("data.pkl")]
    by_name = {info.filename: info for info in infos}
    starts = check_members(checkpoint._fd, infos, source)  # type: ignore[arg-type]
    for info in infos:
        _check_ratio(info, source)
    order = by_name.get(prefix + "byteorder")
    if order is not None:
        text = _small_member(archive, order, source)
        if text not in (b"little", b"big"):
            raise SafetensorError(f"{source}: byteorder is {text[:20]!r}, not little or big")
        checkpoint.big_endian = text == b"big"
    for info in infos:
        if info.filename.startswith(prefix + "data/"):
            key = info.filename[len(prefix + "data/"):]
            checkpoint.ranges[key] = _member_range(checkpoint, archive, info,
                                                   starts[info.filename])
    data = _pickle_bytes(archive, by_name[pickles[0]], source)
    checkpoint.tree = load_pickle(io.BytesIO(data), len(data), source, checkpoint.storage)
    checkpoint.pickle_bytes = len(data)


def _check_ratio(info: zipfile.ZipInfo, source: str) -> None:
    if info.compress_type != zipfile.ZIP_STORED and \
            info.file_size > MAX_COMPRESSION_RATIO * max(info.compress_size, 1):
        raise SafetensorError(
            f"{source}: member {info.filename!r} expands {info.compress_size} bytes to "
            f"{info.file_size}, past the ratio of {MAX_COMPRESSION_RATIO} a checkpoint has "
            f"(a zip bomb?)")


def check_members(fd: int, infos: List[zipfile.ZipInfo], source: str) -> Dict[str, int]:
    """Where the data of each member of the zip archive open as `fd` starts, once
    the sizes its entry declares are checked against the archive's real size: a
    central directory may claim any sizes, and nothing may be planned from them
    before they are known to fit in the file."""
    file_size = os.fstat(fd).st_size
    starts = {}
    for info in infos:
        local = os.pread(fd, LOCAL_HEADER.size, info.header_offset) \
            if 0 <= info.header_offset < file_size else b""
        if len(local) != LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
            raise SafetensorError(f"{source}: member {info.filename!r} has no local header at "
                                  f"byte {info.header_offset}")
        _, name_length, extra_length = LOCAL_HEADER.unpack(local)
        start = info.header_offset + LOCAL_HEADER.size + name_length + extra_length
        if start + info.compress_size > file_size:
            raise SafetensorError(
                f"{source}: member {info.filename!r} declares {info.compress_size} stored "
                f"bytes from byte {start}, past the end of the {file_size}-byte archive")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise SafetensorError(
                f"{source}: member {info.filename!r} is stored uncompressed but declares "
                f"{info.compress_size} bytes stored and {info.file_size} uncompressed")
        starts[info.filename] = start
    return starts


def _small_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> bytes:
    if info.file_size > 64:
        raise SafetensorError(f"{source}: member {info.filename!r} is too large")
    return _read_member(archive, info, source).strip()


def _pickle_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> bytes:
    if info.file_size > MAX_PICKLE_BYTES:
        raise SafetensorError(f"{source}: data.pkl holds {info.file_size} bytes, more than "
                              f"the {MAX_PICKLE_BYTES} a state dict's pickle needs")
    return _read_member(archive, info, source)


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> bytes:
    """The whole of a small member, which must hold the bytes its entry declares."""
    try:
        with archive.open(info) as member:
            data: bytes = member.read(info.file_size + 1)
    except ZIP_ERRORS as error:
        raise SafetensorError(f"{source}: member {info.filename!r} cannot be read "
                              f"({type(error).__name__}: {error})") from None
    if len(data) != info.file_size:
        raise SafetensorError(f"{source}: member {info.filename!r} holds {len(data)} bytes, "
                              f"its entry says {info.file_size}")
    return data


def _member_range(checkpoint: Checkpoint, archive: zipfile.ZipFile, info: zipfile.ZipInfo,
                  start: int) -> Any:
    if info.compress_type != zipfile.ZIP_STORED:
        return CompressedMember(archive, info, checkpoint.source)
    assert checkpoint._fd is not None
    return ByteRange(checkpoint._fd, start, info.file_size, checkpoint.source,
                     f"member {info.filename!r}")


def _read_legacy(checkpoint: Checkpoint, path: str) -> None:
    source = checkpoint.source
    fd = checkpoint._fd
    assert fd is not None
    size = os.fstat(fd).st_size
    with open(path, "rb") as raw:
        head = raw.read(2)
        if head[:1] != b"\x80":
            raise SafetensorError(f"{source}: not a torch checkpoint (neither a zip archive "
                                  f"nor a pickle stream)")
        raw.seek(0)

        def no_storage(key: str, code: str, numel: int) -> StorageRef:
            raise SafetensorError("a storage before the checkpoint's preamble ends")

        magic = load_pickle(raw, size, source, no_storage)
        if magic != LEGACY_MAGIC:
            raise SafetensorError(f"{source}: not a torch checkpoint (a pickle without "
                                  f"torch's magic number)")
        if load_pickle(raw, size, source, no_storage) != LEGACY_PROTOCOL:
            raise SafetensorError(f"{source}: unknown legacy protocol version")
        info = load_pickle(raw, size, source, no_storage)
        if isinstance(info, dict) and info.get("little_endian") is False:
            raise SafetensorError(f"{source}: big-endian legacy checkpoints are not supported")
        start = raw.tell()
        checkpoint.tree = load_pickle(raw, size, source, checkpoint.storage, legacy=True)
        checkpoint.pickle_bytes = raw.tell() - start
        keys = load_pickle(raw, size, source, no_storage)
        if not (isinstance(keys, list) and all(type(key) is str for key in keys)):
            raise SafetensorError(f"{source}: the list of storage keys is malformed")
        _legacy_ranges(checkpoint, keys, raw.tell(), size)


def _legacy_ranges(checkpoint: Checkpoint, keys: List[str], position: int, size: int) -> None:
    """Each storage record is its element count (8 bytes, little-endian), then its
    bytes, little-endian whatever the machine."""
    fd = checkpoint._fd
    assert fd is not None
    for key in keys:
        ref = checkpoint.storages.get(key)
        if ref is None or key in checkpoint.ranges:
            raise SafetensorError(f"{checkpoint.source}: storage record {key!r} is unknown or "
                                  f"given twice")
        count_bytes = os.pread(fd, 8, position)
        if len(count_bytes) != 8:
            raise SafetensorError(f"{checkpoint.source}: the file ends before storage {key!r}")
        count = int.from_bytes(count_bytes, "little")
        itemsize = 1 if key in checkpoint.untyped or not ref.numel else ref.nbytes // ref.numel
        nbytes = count * itemsize
        if position + 8 + nbytes > size:
            raise SafetensorError(f"{checkpoint.source}: storage {key!r} ({nbytes} bytes at "
                                  f"{position + 8}) lies past the end of the file")
        checkpoint.ranges[key] = ByteRange(fd, position + 8, nbytes, checkpoint.source,
                                           f"storage {key!r}")
        position += 8 + nbytes
