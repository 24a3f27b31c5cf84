"""Whole-file reading and writing of NumPy arrays: the functions of
``safetensors.numpy`` (and ``load_into``), over safe_open and the write plan."""
from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Dict, Literal, Mapping, Optional, Protocol, Union,
                    overload)

from ._adapters import NUMPY_FRAMEWORKS, check_numpy_device, converter as framework_converter
from ._core import (DEFAULT_MAX_HEADER_SIZE, Reader, SafetensorError, WritePlan, plan_write,
                    spec_of_array)
from ._files import PathLike
from ._handle import ArrayHandle, Backend, Handle, Openable, open_handle
from ._index import is_checkpoint
from ._source import NOT_LOCAL, as_source

if TYPE_CHECKING:   # none of these is imported when fastst is; numpy.typing costs milliseconds
    import jax  # type: ignore[import-not-found, unused-ignore]
    import numpy.typing as npt
    import torch  # type: ignore[import-not-found, unused-ignore]

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
    source = as_source(filename, storage_options, writing=True)
    if max_shard_size is not None:
        if source.local_path is None:
            raise SafetensorError(NOT_LOCAL)
        if header_padding:
            raise ValueError("header_padding= is not available with max_shard_size=")
        from .checkpoint import save_array_checkpoint   # a capability: imported when used

        save_array_checkpoint(_as_dict(tensor_dict), source.local_path, metadata=metadata,
                              max_shard_size=max_shard_size, fsync=fsync, checksum=checksum)
        return
    source.write(_plan(tensor_dict, metadata, checksum, header_padding), fsync=fsync)


def _plan(tensors: Mapping[str, npt.NDArray[Any]], metadata: Optional[Mapping[str, str]],
          checksum: Optional[str] = None, header_padding: int = 0) -> WritePlan:
    specs = [spec_of_array(name, array) for name, array in _as_dict(tensors).items()]
    if checksum is None:
        return plan_write(specs, metadata, header_padding=header_padding)
    from ._checksums import plan_with_checksums   # imported when checksums are written

    return plan_with_checksums(specs, metadata, checksum, header_padding=header_padding)


def _as_dict(tensors: Mapping[str, Any]) -> Dict[str, Any]:
    if isinstance(tensors, dict):
        return tensors
    if isinstance(tensors, Mapping):
        return dict(tensors.items())
    raise TypeError(f"tensors must be a dict of str to numpy.ndarray, got {type(tensors).__name__}")


@overload
def safe_open(filename: Openable, framework: Literal["np", "numpy"] = "np",
              device: Literal["cpu"] = "cpu", *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None) -> ArrayHandle: ...
@overload
def safe_open(filename: Openable, framework: Literal["pt", "torch", "pytorch"],
              device: Union[str, int, torch.device] = "cpu", *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None) -> Handle[torch.Tensor]: ...
@overload
def safe_open(filename: Openable, framework: Literal["jax", "flax"],
              device: Union[str, jax.Device] = "cpu", *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None) -> Handle[jax.Array]: ...
def safe_open(filename: Openable,
              framework: Literal["np", "numpy", "pt", "torch", "pytorch", "jax", "flax"] = "np",
              device: Any = "cpu", *, backend: Literal["mmap", "pread"] = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None
              ) -> Union[ArrayHandle, Handle[Any]]:
    """Open a safetensors file lazily: validate its header, map it, and hand out
    its tensors, zero-copy where the framework allows.

    Parameters
    ----------
    filename : str, bytes, os.PathLike, URL or binary file object
        A ``.safetensors`` file, or a sharded checkpoint: its directory or its
        ``*.index.json``, opened as one handle over all its shards (a
        ``fastst.checkpoint.ShardedHandle``, whose ``metadata()`` is the index's).
        Or an fsspec URL (``s3://``, ``gs://``, ``http(s)://``, ``memory://``...),
        or a binary file object with ``seek`` and ``read``: the header is read
        first, then only the byte ranges asked for, into fresh memory (backend
        ``"ranges"``; see ``fastst.remote``).
    framework : {"np", "numpy", "pt", "torch", "pytorch", "jax", "flax"}
        ``"np"``/``"numpy"`` (default): NumPy arrays, from a ``NumpyHandle``.
        ``"pt"``/``"torch"``/``"pytorch"``: ``torch.Tensor``s (``fastst.torch``).
        ``"jax"``/``"flax"``: ``jax.Array``s (``fastst.jax``).
        torch and JAX tensors come from a ``FrameworkHandle``, with the same
        reading methods; only these import their framework. For typing, the
        result is an ``ArrayHandle`` for NumPy and a ``Handle`` of the
        framework's tensors otherwise: what one file's handle and a sharded
        checkpoint's have in common.
    device : str, int, torch.device or jax.Device
        ``"cpu"`` (default; the only one for NumPy), or where the framework should
        put the tensors (``"cuda:0"``, ``0``, ``"gpu"``...).
    backend : {"mmap", "pread"}
        ``"mmap"`` (default) maps the file privately: arrays are views, writable,
        and writes never reach the file. ``"pread"`` reads each tensor into fresh
        memory when asked, for files that may change while open. URLs and file objects
        are always read by ranges into fresh memory, whatever `backend` says.
    max_header_size : int
        Largest header accepted, in bytes (100,000,000 by default).
    verify : bool
        Check each tensor's checksum (see ``fastst.integrity``) the first time it
        is read; a file without checksums is refused, and so is one whose
        checksums leave a tensor out (naming it). For a sharded checkpoint, each
        shard is checked so as its tensors are read.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system (credentials,
        ``client_kwargs``, timeouts...).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.eye(2, dtype=np.float32)}, path)
    >>> with fastst.safe_open(path, framework="np") as f:
    ...     f.keys(), f.get_tensor("w").sum(), f.get_slice("w")[1].tolist()
    (['w'], np.float32(2.0), [0.0, 1.0])
    """
    if framework in NUMPY_FRAMEWORKS:
        check_numpy_device(device)
        convert = None
    else:
        convert = framework_converter(framework, device)
    source = as_source(filename, storage_options, backend=backend)
    if is_checkpoint(source):
        from .checkpoint import open_checkpoint   # a capability: imported when used

        return open_checkpoint(source, convert, max_header_size=max_header_size,
                               verify=verify, opened_as=(framework, device))
    return open_handle(source, convert, max_header_size=max_header_size, verify=verify,
                       opened_as=(framework, device))
