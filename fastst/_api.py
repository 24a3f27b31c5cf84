"""Whole-file reading and writing of NumPy arrays: the functions of
``safetensors.numpy`` (and ``load_into``), over safe_open and the write plan."""
from __future__ import annotations

import os
import sys
from typing import (TYPE_CHECKING, Any, Dict, Literal, Mapping, Optional, Protocol, Union,
                    overload)

from ._core import (DEFAULT_MAX_HEADER_SIZE, Reader, SafetensorError, WritePlan, plan_write,
                    spec_of_array)
from ._format.names import is_checkpoint
from ._frameworks.registry import (NUMPY_FRAMEWORKS, check_numpy_device,
                                   converter as framework_converter)
from ._handles.handle import FrameworkHandle, NumpyHandle, open_handle
from ._io.files import PathLike
from ._io.limits import DEFAULT_BACKEND
from ._io.source import NOT_LOCAL, as_source

if TYPE_CHECKING:   # none of these is imported when fastst is; numpy.typing costs milliseconds
    import jax  # type: ignore[import-not-found, unused-ignore]
    import numpy.typing as npt
    import torch  # type: ignore[import-not-found, unused-ignore]

    from ._handles.protocols import ArrayHandle, Backend, Handle, Openable

    class WritableFile(Protocol):
        """A binary file object that save_file writes to in order."""
        def write(self, data: Any, /) -> Optional[int]: ...


__all__ = ["load", "load_file", "load_into", "safe_open", "save", "save_file"]


def load_file(filename: Openable, *, backend: Backend = DEFAULT_BACKEND,
              copy: bool = False, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
              storage_options: Optional[Mapping[str, Any]] = None
              ) -> Dict[str, npt.NDArray[Any]]:
    """Load every tensor of a file, or of a sharded checkpoint, as NumPy arrays.

    The drop-in for ``safetensors.numpy.load_file``. By default the arrays are
    zero-copy views of the file's private map: writable, their writes never
    reach the file, and valid however long they live; a thread reads the
    file's pages in the background (see ``fastst.read_options``). With
    ``copy=True`` each tensor is read into fresh memory of its own (threads
    read large files in parallel, the GIL released), and no array depends on
    the file; the shards of a checkpoint are read in parallel too.

    A URL or a file object is read by byte ranges: every tensor into fresh
    memory, neighbouring tensors in shared requests, big ones in parts fetched
    in parallel.

    Parameters
    ----------
    filename : str, bytes, os.PathLike, URL or binary file object
        A ``.safetensors`` file; a sharded checkpoint, by its directory or its
        ``*.index.json`` (read shard by shard); an fsspec URL (``s3://``,
        ``gs://``, ``https://``...); or a binary file object with ``seek`` and
        ``read``.
    backend : "mmap" or "pread", default "mmap"
        How a local file is read (see `safe_open`).
    copy : bool, default False
        Read each tensor into memory of its own instead of viewing the map.
    max_header_size : int, default 100,000,000
        The largest header accepted, in bytes.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.

    Returns
    -------
    dict of str to numpy.ndarray
        Every tensor, by name, in the order of its bytes in the file (shard by
        shard, in index order, for a checkpoint).

    Raises
    ------
    FileNotFoundError
        When `filename` (or a shard its index names) does not exist.
    SafetensorError
        When the file breaks a rule of the format (a header that does not
        match the file, overlapping tensors, a header over `max_header_size`),
        or a checkpoint's index does not match its shards.
    TypeError
        When `filename` is neither a path, a URL nor a binary file object.

    See Also
    --------
    safe_open : Open a file lazily, and read only the tensors asked for.
    load : Load the bytes of a file held in memory.

    Examples
    --------
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
    """Read the named tensors of a file into caller-supplied arrays, allocating
    nothing.

    For buffers that are reused from one load to the next (pinned memory, a
    model's parameters viewed as NumPy arrays, shared memory): the bytes go
    straight from the file into them, the GIL released.

    Parameters
    ----------
    filename : str, bytes, os.PathLike, URL or binary file object
        The file, or a sharded checkpoint (see `load_file`).
    arrays : mapping of str to numpy.ndarray
        For each tensor to read, an array that is C-contiguous, writable, and
        of the tensor's dtype and shape (its NumPy array shape, see
        ``fastst.TensorInfo``). Tensors not named are not read.
    max_header_size : int, default 100,000,000
        The largest header accepted, in bytes.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.

    Raises
    ------
    TensorNotFoundError
        When a name is not a tensor of the file.
    ValueError
        When an array is not of its tensor's dtype and shape, or not
        C-contiguous.
    FileNotFoundError
        When the file does not exist.
    SafetensorError
        When the file breaks a rule of the format.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.full((2, 2), 7, np.int32), "b": np.ones(2)}, path)
    >>> w = np.empty((2, 2), np.int32)
    >>> fastst.load_into(path, {"w": w})
    >>> w.tolist()
    [[7, 7], [7, 7]]
    """
    with safe_open(filename, max_header_size=max_header_size,
                   storage_options=storage_options) as reader:
        reader.read_into(dict(arrays))


def load(data: Any, *, copy: bool = False, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
         ) -> Dict[str, npt.NDArray[Any]]:
    """Load the tensors of a safetensors file held in memory, without copying.

    The arrays view `data` and keep it alive; they are read-only when `data`
    is (``bytes``), writable when it is (``bytearray``), and then share its
    memory. With ``copy=True`` each tensor is read into writable memory of
    its own, as ``safetensors.numpy.load`` returns them (``fastst.numpy.load``
    does so).

    Parameters
    ----------
    data : bytes-like object
        The whole file: bytes, bytearray, memoryview, mmap, or a 1-d uint8
        NumPy array.
    copy : bool, default False
        Read each tensor into memory of its own instead of viewing `data`.
    max_header_size : int, default 100,000,000
        The largest header accepted, in bytes.

    Returns
    -------
    dict of str to numpy.ndarray
        Every tensor, by name, in the order of its bytes in `data`.

    Raises
    ------
    SafetensorError
        When the bytes break a rule of the format.
    SafetensorTypeError
        When `data` is not a bytes-like object.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> arrays = fastst.load(fastst.save({"x": np.arange(3, dtype=np.uint8)}))
    >>> arrays["x"].tolist(), arrays["x"].flags.writeable
    ([0, 1, 2], False)
    """
    reader = Reader()
    reader.open_buffer(data, max_header_size=max_header_size)
    return reader.copy_tensors() if copy else reader.get_tensors()


def save(tensor_dict: Mapping[str, npt.NDArray[Any]],
         metadata: Optional[Mapping[str, str]] = None, *, checksum: Optional[str] = None,
         align: Optional[int] = None) -> bytes:
    """Serialize NumPy arrays into the bytes of a safetensors file.

    The drop-in for ``safetensors.numpy.save``. The bytes are those huggingface
    safetensors writes for the same input (which orders several metadata keys
    at random; fastst sorts them), and the same whatever the insertion order of
    `tensor_dict` and `metadata`. Non-contiguous and big-endian arrays are
    written as C-ordered, little-endian data, as the format stores them.

    Parameters
    ----------
    tensor_dict : mapping of str to numpy.ndarray
        The tensors, by name. Any dtype of ``fastst.DTYPES`` that NumPy has:
        bool, integers, floats, complex64, and ml_dtypes' bfloat16 and float8.
    metadata : mapping of str to str, optional
        The header's ``__metadata__``.
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata (see
        ``fastst.integrity``; needs the ``xxhash`` package).
    align : int, optional
        Start the tensor data, and as many tensors as can, at multiples of
        this many bytes (a power of two, at most 1 MiB): the header is padded
        with spaces and the tensors ordered to fit (an aligned file, which
        every safetensors reader reads; its bytes are no longer the
        reference's). None or 0: the reference's layout.

    Returns
    -------
    bytes
        The whole file.

    Raises
    ------
    TypeError
        When `tensor_dict` is not a mapping of str to NumPy arrays, or a
        metadata key or value is not a str.
    SafetensorTypeError
        When an array's dtype has no safetensors code (strings, objects...).
    ValueError
        When `checksum` is not a known algorithm, or `metadata` holds the
        key the checksums use; `SafetensorError` when `align` is not a power
        of two up to 1 MiB.

    See Also
    --------
    save_file : Write the file to disk, atomically.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> data = fastst.save({"x": np.zeros(2, np.float32)}, {"format": "np"})
    >>> header_size = int.from_bytes(data[:8], "little")
    >>> data[8:8 + header_size]
    b'{"__metadata__":{"format":"np"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}   '
    >>> len(data) == 8 + header_size + 8
    True
    """
    return _plan(tensor_dict, metadata, checksum, align=align).to_bytes()


def save_file(tensor_dict: Mapping[str, npt.NDArray[Any]],
              filename: Union[PathLike, WritableFile],
              metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False,
              max_shard_size: Union[int, str, None] = None, checksum: Optional[str] = None,
              header_padding: int = 0, storage_options: Optional[Mapping[str, Any]] = None,
              align: Optional[int] = None) -> None:
    """Write NumPy arrays to a safetensors file, atomically.

    The drop-in for ``safetensors.numpy.save_file``, with the same bytes (see
    `save`). The file is written beside the target under a temporary name
    (``.<name>.<random>.fastst-tmp``) and renamed over it, so readers see the
    old file or the new one, never a mix, and a failed save leaves the old file
    as it was. The new file keeps the permission bits of the file it replaces
    (a new one gets what ``open()`` gives: ``0o666`` less the umask); its owner
    is the saving user.

    A URL is uploaded: on S3 and Google Cloud Storage in parts as it is
    written, the object appearing only when complete (a failed save leaves the
    previous one); elsewhere it is put whole. A file object is written in
    order from its position.

    Parameters
    ----------
    tensor_dict : mapping of str to numpy.ndarray
        The tensors, by name (see `save`).
    filename : str, bytes, os.PathLike, URL or writable binary file object
        Where to write.
    metadata : mapping of str to str, optional
        The header's ``__metadata__``.
    fsync : bool, default False
        Flush the file and its directory to disk before returning, so that
        the new file also survives a power loss.
    max_shard_size : int or str, optional
        Cut the tensors into shards of at most this many bytes (or a size such
        as ``"5GB"``), as the Hugging Face tools cut them: `filename` is then
        the directory to save into, or ``DIR/NAME.safetensors`` for shards
        named after NAME (see ``fastst.checkpoint.save_checkpoint``). A
        checkpoint saved over another opens as the old one or the new one,
        never a mix, even if the save is killed. Local paths only.
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata (each shard's own, for a
        checkpoint); see `save`.
    header_padding : int, default 0
        Bytes of spaces reserved after the header, so that
        ``fastst.update_metadata`` can later rewrite the metadata in place,
        without copying the tensors. Not with `max_shard_size`.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.
    align : int, optional
        Start the tensor data, and as many tensors as can, at multiples of
        this many bytes in the file (each shard's, for a checkpoint); see
        `save`.

    Raises
    ------
    OSError
        When the file cannot be written (a missing directory, no permission,
        a full disk): the old file, if any, is left as it was.
    TypeError
        When `tensor_dict` is not a mapping of str to NumPy arrays, or a
        metadata key or value is not a str.
    SafetensorTypeError
        When an array's dtype has no safetensors code.
    SafetensorError
        When `max_shard_size` is not a size, or is given for a URL or a file
        object; when `header_padding` is out of range, or `align` is not a
        power of two up to 1 MiB.
    ValueError
        When `checksum` is not known, or `header_padding` is given with
        `max_shard_size`.

    See Also
    --------
    fastst.writer.StreamWriter : Write a file in pieces, in any order.
    fastst.update_metadata : Edit the metadata of a saved file.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> path = os.path.join(folder, "model.safetensors")
    >>> fastst.save_file({"w": np.ones((2, 2), np.float32)}, path, metadata={"step": "3"})
    >>> os.path.getsize(path), os.listdir(folder)
    (112, ['model.safetensors'])

    Sharded, as the Hugging Face tools save a checkpoint:

    >>> tensors = {f"layer{i}": np.zeros(100, np.float32) for i in range(3)}
    >>> fastst.save_file(tensors, folder, max_shard_size=800)
    >>> sorted(name for name in os.listdir(folder) if name.startswith("model-"))
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    source = as_source(filename, storage_options, writing=True)
    if max_shard_size is not None:
        if source.local_path is None:
            raise SafetensorError(NOT_LOCAL)
        if header_padding:
            raise ValueError("header_padding= is not available with max_shard_size=")
        from .checkpoint import save_array_checkpoint   # a capability: imported when used

        save_array_checkpoint(_as_dict(tensor_dict), source.local_path, metadata=metadata,
                              max_shard_size=max_shard_size, fsync=fsync, checksum=checksum,
                              align=align)
        return
    source.write(_plan(tensor_dict, metadata, checksum, header_padding, align), fsync=fsync)


def _plan(tensors: Mapping[str, npt.NDArray[Any]], metadata: Optional[Mapping[str, str]],
          checksum: Optional[str] = None, header_padding: int = 0,
          align: Optional[int] = None) -> WritePlan:
    specs = [spec_of_array(name, array) for name, array in _as_dict(tensors).items()]
    if checksum is None:
        return plan_write(specs, metadata, header_padding=header_padding, align=align)
    from ._format.checksums import plan_with_checksums   # imported when checksums are written

    return plan_with_checksums(specs, metadata, checksum, header_padding=header_padding,
                               align=align)


def _as_dict(tensors: Mapping[str, Any]) -> Dict[str, Any]:
    if isinstance(tensors, dict):
        return tensors
    if isinstance(tensors, Mapping):
        return dict(tensors.items())
    raise TypeError(f"tensors must be a dict of str to numpy.ndarray, got {type(tensors).__name__}")


class _OpensHandles(type):
    """The type of `safe_open`: ``isinstance(f, safe_open)`` holds for what it
    returns (a ``NumpyHandle``, a ``FrameworkHandle``, a checkpoint's
    ``ShardedHandle``), as for the reference's ``safe_open`` objects."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return cls.__subclasscheck__(type(instance))

    def __subclasscheck__(cls, subclass: type) -> bool:
        if subclass is cls or issubclass(subclass, (NumpyHandle, FrameworkHandle)):
            return True
        # a checkpoint's handles exist only once their module is imported
        checkpoint = sys.modules.get("fastst.checkpoint")
        return checkpoint is not None and issubclass(subclass, checkpoint.ShardedHandle)


class safe_open(metaclass=_OpensHandles):
    """Open a safetensors file lazily: validate its header, map it, and hand out
    its tensors, zero-copy where the framework allows.

    The drop-in for ``safetensors.safe_open``, and a context manager. Nothing
    but the header is read until a tensor is asked for; the whole header is
    checked against the file first, so that no tensor of a malformed file is
    ever handed out. Arrays stay valid after the handle is closed. Calling it
    gives the handle the file needs (see Returns), of which
    ``isinstance(f, safe_open)`` is true, as of the reference's objects.

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
    framework : str, default "np"
        One of ``"np"``, ``"numpy"``, ``"pt"``, ``"torch"``, ``"pytorch"``,
        ``"jax"``, ``"flax"``, ``"mlx"``, ``"tf"``, ``"tensorflow"``,
        ``"paddle"``.
        ``"np"``/``"numpy"`` (default): NumPy arrays, from a ``NumpyHandle``.
        ``"pt"``/``"torch"``/``"pytorch"``: ``torch.Tensor``s (``fastst.torch``).
        ``"jax"``/``"flax"``: ``jax.Array``s (``fastst.jax``).
        ``"mlx"``, ``"tf"``/``"tensorflow"``, ``"paddle"``: MLX arrays,
        TensorFlow and PaddlePaddle tensors, made from the NumPy arrays (copies).
        Other frameworks' tensors come from a ``FrameworkHandle``, with the same
        reading methods; only these import their framework. For typing, the
        result is an ``ArrayHandle`` for NumPy and a ``Handle`` of the
        framework's tensors otherwise (of ``Any`` for a framework held in a
        ``str``): what one file's handle and a sharded checkpoint's have in
        common.
    device : str or int or torch.device or jax.Device, default "cpu"
        ``"cpu"`` (default; the only one for NumPy), or where the framework should
        put the tensors (``"cuda:0"``, ``0``, ``"gpu"``...).
    backend : "mmap" or "pread", default "mmap"
        ``"mmap"`` maps the file privately: arrays are views, writable, and
        writes never reach the file. ``"pread"`` reads each tensor into fresh
        memory when asked, for files that may change while open, several large
        requests in flight. Left to its default, a file on a network file system
        (NFS, FUSE such as sshfs or virtiofs, Lustre, CephFS, SMB, 9p, AFS,
        GPFS), where each fault of a map waits for a round trip, is read with
        ``"pread"``; ``backend="mmap"`` given maps it all the same. The handle's
        ``backend`` tells which. URLs and file objects
        are always read by ranges into fresh memory, whatever `backend` says.
    max_header_size : int, default 100,000,000
        Largest header accepted, in bytes (``fastst.DEFAULT_MAX_HEADER_SIZE``).
    verify : bool, default False
        Check each tensor's checksum (see ``fastst.integrity``) the first time it
        is read; a file without checksums is refused, and so is one whose
        checksums leave a tensor out (naming it). For a sharded checkpoint, each
        shard is checked so as its tensors are read.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system (credentials,
        ``client_kwargs``, timeouts...).

    Returns
    -------
    NumpyHandle or FrameworkHandle or fastst.checkpoint.ShardedHandle
        The open file: a `NumpyHandle` for NumPy (a
        ``fastst.integrity.VerifyingHandle`` with `verify`), a
        `FrameworkHandle` for other frameworks, a ``ShardedHandle`` (its
        ``NumpyShardedHandle`` for NumPy) for a sharded checkpoint.

    Raises
    ------
    FileNotFoundError
        When the file does not exist (`IsADirectoryError`, `PermissionError`
        and other `OSError` as the system gives them).
    SafetensorError
        When the file breaks a rule of the format, its header is longer than
        `max_header_size`, `framework`, `device` or `backend` is not known, or
        `verify` finds no checksums.
    TypeError
        When `filename` is neither a path, a URL nor a binary file object.
    ImportError
        When the framework (its message names the package to install), or
        fsspec for a URL, is not installed.

    See Also
    --------
    load_file : Every tensor at once.
    SafeSlice : What ``get_slice`` returns.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.eye(2, dtype=np.float32)}, path)
    >>> with fastst.safe_open(path, framework="np") as f:
    ...     f.keys(), f.get_tensor("w").sum(), f.get_slice("w")[1].tolist()
    (['w'], np.float32(2.0), [0.0, 1.0])

    A file object is read by byte ranges, as a URL is:

    >>> import io
    >>> with fastst.safe_open(io.BytesIO(fastst.save({"x": np.arange(3)}))) as f:
    ...     f.backend, f.get_tensor("x").tolist()
    ('ranges', [0, 1, 2])
    """

    @overload
    def __new__(  # type: ignore[misc]  # a handle, not a safe_open: see _OpensHandles
            cls, filename: Openable, framework: Literal["np", "numpy"] = "np",
            device: Literal["cpu"] = "cpu", *, backend: Backend = DEFAULT_BACKEND,
            max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
            storage_options: Optional[Mapping[str, Any]] = None) -> ArrayHandle: ...
    @overload
    def __new__(  # type: ignore[misc]
            cls, filename: Openable, framework: Literal["pt", "torch", "pytorch"],
            device: Union[str, int, torch.device] = "cpu", *, backend: Backend = DEFAULT_BACKEND,
            max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
            storage_options: Optional[Mapping[str, Any]] = None
            ) -> Handle[torch.Tensor]: ...
    @overload
    def __new__(  # type: ignore[misc]
            cls, filename: Openable, framework: Literal["jax", "flax"],
            device: Union[str, jax.Device] = "cpu", *, backend: Backend = DEFAULT_BACKEND,
            max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
            storage_options: Optional[Mapping[str, Any]] = None) -> Handle[jax.Array]: ...
    @overload
    def __new__(  # type: ignore[misc]
            cls, filename: Openable, framework: str, device: Any = "cpu", *,
            backend: Backend = DEFAULT_BACKEND, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
            verify: bool = False, storage_options: Optional[Mapping[str, Any]] = None
            ) -> Handle[Any]: ...
    def __new__(  # type: ignore[misc]
            cls, filename: Openable,
            framework: Union[Literal["np", "numpy", "pt", "torch", "pytorch", "jax", "flax",
                                     "mlx", "tf", "tensorflow", "paddle"], str] = "np",
            device: Any = "cpu", *, backend: Literal["mmap", "pread"] = DEFAULT_BACKEND,
            max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
            storage_options: Optional[Mapping[str, Any]] = None
            ) -> Union[ArrayHandle, Handle[Any]]:
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


def _safe_open_handle(f: Any, framework: str, device: Any = "cpu", *,
                      backend: Backend = DEFAULT_BACKEND) -> Handle[Any]:
    """Open the file behind an open file object, as ``safetensors._safe_open_handle``
    (0.6.2 and later) does.

    A file object with a ``fileno`` and a ``name`` (a built-in file, fsspec's
    local files) is opened again by its name, so that it is mapped; any other
    binary file object with ``seek`` and ``read`` (a remote file) is read by byte
    ranges, as `safe_open` reads it.

    Parameters
    ----------
    f : file object
        An open file, in text or binary mode.
    framework : str
        As for `safe_open`.
    device : str or int or torch.device or jax.Device, default "cpu"
        As for `safe_open`.
    backend : "mmap" or "pread", default "mmap"
        How a file opened by its name is read (see `safe_open`).

    Returns
    -------
    NumpyHandle or FrameworkHandle
        The open file, as `safe_open` gives it.

    Raises
    ------
    TypeError
        When `f` has neither a name to open nor ``seek`` and ``read``.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"x": np.arange(3)}, path)
    >>> with open(path) as f, fastst._safe_open_handle(f, "np") as g:
    ...     g.backend, g.get_tensor("x").tolist()
    ('mmap', [0, 1, 2])
    """
    name = getattr(f, "name", None)
    if hasattr(f, "fileno") and isinstance(name, (str, bytes, os.PathLike)):
        return safe_open(name, framework, device, backend=backend)
    return safe_open(f, framework, device, backend=backend)


# The reference's low-level names, which safetensors.numpy and safetensors.torch
# re-export: fastst.numpy and fastst.torch take them from ``lowlevel`` on their first
# use, off a first load's path (``lowlevel`` imports the checksums and torch's dtypes).
LOWLEVEL = ("TensorSpec", "deserialize", "serialize", "serialize_file")


def lowlevel_name(face: str, name: str, namespace: Dict[str, Any]) -> Any:
    """The module ``__getattr__`` of the face `face`: `name` from ``lowlevel``, kept in
    the face's `namespace`, where it is found directly from then on."""
    if name not in LOWLEVEL:
        raise AttributeError(f"module {face!r} has no attribute {name!r}")
    from ._format import lowlevel

    value = namespace[name] = getattr(lowlevel, name)
    return value
