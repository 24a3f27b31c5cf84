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
from typing import Any, Dict, List, Optional, Set

from .. import SafetensorError
from ._torch_pickle import UNTYPED, StorageRef, load_pickle

__all__ = ["Checkpoint", "open_checkpoint", "MAX_PICKLE_BYTES", "MAX_COMPRESSION_RATIO"]

MAX_PICKLE_BYTES = 1 << 30          # a data.pkl larger than this is not a state dict
MAX_COMPRESSION_RATIO = 100         # past it a compressed member is taken for a zip bomb
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
LOCAL_HEADER = struct.Struct("<4s22xHH")
CHUNK = 16 << 20


class ByteRange:
    """`size` bytes of file `path` from byte `start`, read with pread."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        self.fd, self.start, self.size = fd, start, size

    def read_into(self, begin: int, out: memoryview) -> None:
        position, view = self.start + begin, out
        while len(view):
            got = os.preadv(self.fd, [view], position)
            if got <= 0:
                raise OSError(f"the file ended inside a storage, at byte {position}")
            view, position = view[got:], position + got


class CompressedMember:
    """A compressed zip member, decompressed as it is read. The stream stays open
    between reads, so that reading a tensor chunk after chunk decompresses each
    byte once; only a read that goes back starts again from the member's start."""

    def __init__(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
        self.archive, self.info, self.size = archive, info, info.file_size
        self._member: Any = None

    def read_into(self, begin: int, out: memoryview) -> None:
        if self._member is None or self._member.tell() > begin:
            if self._member is not None:
                self._member.close()
            self._member = self.archive.open(self.info)
        self._member.seek(begin)        # forward: decompresses only what lies between
        view = out
        while len(view):
            data = self._member.read(min(len(view), CHUNK))
            if not data:
                raise SafetensorError(f"zip member {self.info.filename!r} ends early")
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


def open_checkpoint(path: str) -> Checkpoint:
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
    except (zipfile.BadZipFile, ValueError, OSError) as error:
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
    file_size = os.fstat(checkpoint._fd).st_size  # type: ignore[arg-type]
    order = by_name.get(prefix + "byteorder")
    if order is not None:
        text = _small_member(archive, order, source)
        if text not in (b"little", b"big"):
            raise SafetensorError(f"{source}: byteorder is {text[:20]!r}, not little or big")
        checkpoint.big_endian = text == b"big"
    for info in infos:
        if info.filename.startswith(prefix + "data/"):
            key = info.filename[len(prefix + "data/"):]
            checkpoint.ranges[key] = _member_range(checkpoint, archive, info, file_size)
    data = _pickle_bytes(archive, by_name[pickles[0]], source)
    checkpoint.tree = load_pickle(io.BytesIO(data), len(data), source, checkpoint.storage)


def _check_ratio(info: zipfile.ZipInfo, source: str) -> None:
    if info.compress_type != zipfile.ZIP_STORED and \
            info.file_size > MAX_COMPRESSION_RATIO * max(info.compress_size, 1):
        raise SafetensorError(
            f"{source}: member {info.filename!r} expands {info.compress_size} bytes to "
            f"{info.file_size}, past the ratio of {MAX_COMPRESSION_RATIO} a checkpoint has "
            f"(a zip bomb?)")


def _small_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> bytes:
    if info.file_size > 64:
        raise SafetensorError(f"{source}: member {info.filename!r} is too large")
    _check_ratio(info, source)
    return archive.read(info).strip()


def _pickle_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> bytes:
    if info.file_size > MAX_PICKLE_BYTES:
        raise SafetensorError(f"{source}: data.pkl holds {info.file_size} bytes, more than "
                              f"the {MAX_PICKLE_BYTES} a state dict's pickle needs")
    _check_ratio(info, source)
    try:
        with archive.open(info) as member:
            data = member.read(info.file_size + 1)
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise SafetensorError(f"{source}: data.pkl cannot be read ({error})") from None
    if len(data) != info.file_size:
        raise SafetensorError(f"{source}: data.pkl holds {len(data)} bytes, its entry says "
                              f"{info.file_size}")
    return data


def _member_range(checkpoint: Checkpoint, archive: zipfile.ZipFile, info: zipfile.ZipInfo,
                  file_size: int) -> Any:
    source = checkpoint.source
    _check_ratio(info, source)
    if info.compress_type != zipfile.ZIP_STORED:
        return CompressedMember(archive, info)
    fd = checkpoint._fd
    assert fd is not None
    local = os.pread(fd, LOCAL_HEADER.size, info.header_offset)
    if len(local) != LOCAL_HEADER.size or local[:4] != b"PK\x03\x04":
        raise SafetensorError(f"{source}: member {info.filename!r} has no local header at "
                              f"byte {info.header_offset}")
    _, name_length, extra_length = LOCAL_HEADER.unpack(local)
    start = info.header_offset + LOCAL_HEADER.size + name_length + extra_length
    if info.file_size != info.compress_size or start + info.file_size > file_size:
        raise SafetensorError(f"{source}: member {info.filename!r} (bytes {start} to "
                              f"{start + info.file_size}) lies outside the {file_size}-byte "
                              f"archive")
    return ByteRange(fd, start, info.file_size)


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
        checkpoint.tree = load_pickle(raw, size, source, checkpoint.storage, legacy=True)
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
        checkpoint.ranges[key] = ByteRange(fd, position + 8, nbytes)
        position += 8 + nbytes
