"""Whole-file reading and writing of NumPy arrays: the functions of
``safetensors.numpy`` (and ``load_into``), over safe_open and the write plan."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Protocol, Union, cast

from ._core import DEFAULT_MAX_HEADER_SIZE, Reader, SafetensorError, WritePlan, spec_of_array
from ._files import PathLike, write_atomically
from ._handle import Backend, Openable, is_url, safe_open
from .integrity import plan_with_checksums

if TYPE_CHECKING:   # numpy.typing costs milliseconds to import
    import numpy.typing as npt

class WritableFile(Protocol):
    """A binary file object that save_file writes to in order."""
    def write(self, data: Any, /) -> Optional[int]: ...


__all__ = ["load", "load_file", "load_into", "safe_open", "save", "save_file"]


def load_file(filename: Openable, *, backend: Backend = "mmap",
              copy: bool = False, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
              storage_options: Optional[Mapping[str, Any]] = None
              ) -> Dict[str, npt.NDArray[Any]]:
    """Load every tensor of a file, in buffer order, or of a sharded checkpoint
    (its directory or ``*.index.json``), shard by shard.

    By default the arrays are zero-copy views of the file's private map. With
    ``copy=True`` each tensor is read into fresh memory of its own (threads read
    large files in parallel, the GIL released), and no array depends on the file;
    the shards of a checkpoint are read in parallel too.

    `filename` may also be an fsspec URL (with its `storage_options`) or a binary
    file object: every tensor is then read into fresh memory, neighbouring
    tensors in shared requests, big ones in parts fetched in parallel.

    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"b": np.zeros(2, np.int8), "a": np.ones(1)}, path)
    >>> {name: array.tolist() for name, array in fastst.load_file(path).items()}
    {'a': [1.0], 'b': [0, 0]}
    """
    with safe_open(filename, backend=backend, max_header_size=max_header_size,
                   storage_options=storage_options) as reader:
        return reader.copy_tensors() if copy else reader.get_tensors()


def load_into(filename: Openable, arrays: Mapping[str, npt.NDArray[Any]], *,
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
              storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Read the named tensors of a file (or URL, or file object) into
    caller-supplied arrays, allocating nothing. Each array must be C-contiguous,
    writable, and of its tensor's dtype and shape."""
    with safe_open(filename, max_header_size=max_header_size,
                   storage_options=storage_options) as reader:
        reader.read_into(dict(arrays))


def load(data: Any, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
         ) -> Dict[str, npt.NDArray[Any]]:
    """Load tensors from a buffer (bytes, bytearray, memoryview, mmap) without copying.

    The arrays view `data` and keep it alive; they are read-only when `data` is.

    >>> import numpy as np, fastst
    >>> fastst.load(fastst.save({"x": np.arange(3, dtype=np.uint8)}))["x"].tolist()
    [0, 1, 2]
    """
    reader = Reader()
    reader.open_buffer(data, max_header_size=max_header_size)
    return reader.get_tensors()


def save(tensor_dict: Mapping[str, npt.NDArray[Any]],
         metadata: Optional[Mapping[str, str]] = None, *, checksum: Optional[str] = None
         ) -> bytes:
    """Serialize tensors into the bytes of a safetensors file.

    The bytes are those huggingface safetensors writes for the same input (which
    orders several metadata keys at random; fastst sorts them), and the same
    whatever the insertion order of `tensor_dict` and `metadata`. With `checksum`
    (``"xxh3_64"`` or ``"xxh3_128"``) each tensor's checksum goes into the metadata
    (see ``fastst.integrity``).
    """
    return _plan(tensor_dict, metadata, checksum).to_bytes()


def save_file(tensor_dict: Mapping[str, npt.NDArray[Any]],
              filename: Union[PathLike, WritableFile],
              metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False,
              max_shard_size: Union[int, str, None] = None, checksum: Optional[str] = None,
              header_padding: int = 0, storage_options: Optional[Mapping[str, Any]] = None
              ) -> None:
    """Write tensors to `filename` atomically.

    The file is written beside the target under a temporary name
    (``.<name>.<random>.fastst-tmp``) and renamed over it, so readers see the old
    file or the new one, never a mix, and a failed save leaves the old file as it
    was. The new file keeps the permission bits of the file it replaces (a new
    one gets what ``open()`` gives: ``0o666`` less the umask); its owner is the
    saving user. With ``fsync=True`` the file and its directory are flushed to
    disk before returning, so the new file also survives a power loss.
    `checksum` is that of ``save``. `header_padding` reserves that many bytes of spaces after the
    header, so that ``fastst.update_metadata`` can later rewrite the metadata in
    place, without copying the tensors.

    With `max_shard_size` (bytes, or a size such as ``"5GB"``) the tensors are cut
    into shards as the Hugging Face tools cut them, and `filename` is the
    directory to save into, or ``DIR/NAME.safetensors`` for shards named after
    NAME (see ``fastst.checkpoint.save_checkpoint``); with `checksum`, each shard
    holds the checksums of its tensors. A checkpoint saved over another opens as
    the old one or the new one, never a mix, even if the save is killed.

    `filename` may also be an fsspec URL (with its `storage_options`): on S3 and
    Google Cloud Storage the file is uploaded in parts as it is written and the
    object appears only when complete (a failed save leaves the previous one);
    elsewhere it is put whole. Or a writable binary file object, written in order
    from its position.
    """
    if is_url(filename) or _is_writable_object(filename):
        if fsync or max_shard_size is not None:
            raise SafetensorError("fsync= and max_shard_size= apply to local paths, not to "
                                  "URLs or file objects")
        from .remote import save_plan   # a capability: imported when used

        save_plan(_plan(tensor_dict, metadata, checksum, header_padding), filename, storage_options)
        return
    if storage_options:
        raise SafetensorError("storage_options apply to URLs only")
    path = cast(PathLike, filename)   # neither a URL nor a file object
    if max_shard_size is not None:
        from .checkpoint import save_array_checkpoint   # a capability: imported when used

        if header_padding:
            raise ValueError("header_padding= is not available with max_shard_size=")
        save_array_checkpoint(_as_dict(tensor_dict), path, metadata=metadata,
                              max_shard_size=max_shard_size, fsync=fsync, checksum=checksum)
        return
    write_atomically(_plan(tensor_dict, metadata, checksum, header_padding), path, fsync=fsync)


def _is_writable_object(target: Any) -> bool:
    return (not isinstance(target, (str, bytes, os.PathLike))
            and callable(getattr(target, "write", None)))


def _plan(tensors: Mapping[str, npt.NDArray[Any]], metadata: Optional[Mapping[str, str]],
          checksum: Optional[str] = None, header_padding: int = 0) -> WritePlan:
    specs = [spec_of_array(name, array) for name, array in _as_dict(tensors).items()]
    return plan_with_checksums(specs, metadata, checksum, header_padding=header_padding)


def _as_dict(tensors: Mapping[str, Any]) -> Dict[str, Any]:
    if isinstance(tensors, dict):
        return tensors
    if isinstance(tensors, Mapping):
        return dict(tensors.items())
    raise TypeError(f"tensors must be a dict of str to numpy.ndarray, got {type(tensors).__name__}")
