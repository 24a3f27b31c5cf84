"""The compiled core of fastst (the format core, fastst._core), its stub split by concern
beside the code each part describes. The API reference is generated from these stubs'
docstrings, whose first paragraphs are the compiled module's own docstrings
(tests/test_core_docstrings.py holds them equal); their examples run in
tests/test_docs.py."""
from .dtypes import (
    DTYPES as DTYPES,
    DTYPE_CODES as DTYPE_CODES,
    DtypeInfo as DtypeInfo,
    dtype_bits as dtype_bits,
    numpy_dtype as numpy_dtype,
)
from .header import (
    DEFAULT_MAX_HEADER_SIZE as DEFAULT_MAX_HEADER_SIZE,
    TensorInfo as TensorInfo,
    foreign_format as foreign_format,
)
from .sources import (
    ReadOptions as ReadOptions,
    file_system_type as file_system_type,
    free_huge_page_bytes as free_huge_page_bytes,
    hint_sequential as hint_sequential,
    read_ahead_limit as read_ahead_limit,
    read_counters as read_counters,
    read_options as read_options,
    read_threads as read_threads,
    usable_cpus as usable_cpus,
    use_huge_page_settings as use_huge_page_settings,
)
from .reader import (
    Reader as Reader,
)
from .runs import (
    read_runs as read_runs,
)
from .writer import (
    ALIGNED_HEADER_SPACES as ALIGNED_HEADER_SPACES,
    MAX_ALIGN as MAX_ALIGN,
    SupportsWrite as SupportsWrite,
    WritePlan as WritePlan,
    WriteSpec as WriteSpec,
    plan_write as plan_write,
    spec_of_array as spec_of_array,
    write_array_at as write_array_at,
)
# the ring's names, loaded with the first used (fastst._core._ring)
from ._ring import (
    BatchRing as BatchRing,
    READER_FAILED as READER_FAILED,
    SHUFFLE_BUCKET_ROWS as SHUFFLE_BUCKET_ROWS,
    STOPPED as STOPPED,
    TAKER_FILLS_BATCH_BYTES as TAKER_FILLS_BATCH_BYTES,
    WATCH_FROM_FILES as WATCH_FROM_FILES,
    deal_rows as deal_rows,
    last_level_cache as last_level_cache,
    shuffle_rows as shuffle_rows,
)

# The SafetensorError family: here, so that type checkers name each as fastst._core does.

class SafetensorError(ValueError):
    """A file, a buffer, a tensor or an argument breaks a rule of the format.

    The base of fastst's errors, and a `ValueError`, as the reference's
    ``SafetensorError`` is. The message names the file (or ``<buffer>``), the
    tensor and the rule broken: ``"model.safetensors: tensor 'w': data_offsets
    [0, 8] overlap tensor 'b'"``. Where the reference raises another built-in
    type, fastst raises a subclass that is both: `TensorNotFoundError`,
    `SafetensorIndexError`, `SafetensorTypeError`,
    `SafetensorNotImplementedError`.

    Examples
    --------
    >>> import fastst
    >>> try:
    ...     fastst.load(b"short")
    ... except fastst.SafetensorError as error:
    ...     print(error)
    <buffer>: file is 5 bytes, shorter than the 8-byte header length
    """

class SafetensorIndexError(SafetensorError, IndexError):
    """An index or a row reaches outside a tensor.

    Both a `SafetensorError` and the `IndexError` NumPy raises for the same
    index.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.arange(3)}, path)
    >>> try:
    ...     with fastst.safe_open(path) as f:
    ...         f.get_slice("x")[5]
    ... except IndexError as error:
    ...     print(type(error).__name__, "-", error)
    SafetensorIndexError - Error during slicing [5] with shape [3]: index 5 out of bounds for tensor dimension #0 of size 3 (tensor 'x' of ...x.safetensors)
    """

class SafetensorTypeError(SafetensorError, TypeError):
    """A value of a type, or a dtype, that safetensors cannot store.

    Both a `SafetensorError` and a `TypeError`.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> try:
    ...     fastst.save({"text": np.array(["a"])})
    ... except TypeError as error:
    ...     print(type(error).__name__, "-", error)
    SafetensorTypeError - tensor 'text': dtype <U1 has no safetensors code (supported: ...)
    """

class SafetensorNotImplementedError(SafetensorError, NotImplementedError):
    """Something the format, or fastst, cannot do.

    Saving a tensor that has no data (torch's meta device), a dask array of a
    sub-byte dtype, a view onto a file that cannot be mapped. Both a
    `SafetensorError` and the `NotImplementedError` (a `RuntimeError`) the
    reference raises.

    Examples
    --------
    >>> import fastst
    >>> issubclass(fastst.SafetensorNotImplementedError, NotImplementedError)
    True
    """

class NoSuchFileError(FileNotFoundError):
    """A file to open that does not exist.

    The `FileNotFoundError` the system gives (its ``errno``, ``strerror`` and
    ``filename``), whose message is worded as the reference's:
    ``No such file or directory: PATH``.

    Examples
    --------
    >>> import fastst
    >>> try:
    ...     fastst.safe_open("missing.safetensors")
    ... except FileNotFoundError as error:
    ...     print(error, error.errno)
    No such file or directory: missing.safetensors 2
    """

class TensorNotFoundError(SafetensorError, KeyError):
    """The file holds no tensor of that name.

    Both a `SafetensorError` and a `KeyError`, as a mapping raises; its
    message is the plain text, not a quoted key.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.zeros(1)}, path)
    >>> try:
    ...     with fastst.safe_open(path) as f:
    ...         f.get_tensor("y")
    ... except KeyError as error:
    ...     print(type(error).__name__, "-", error)
    TensorNotFoundError - ...x.safetensors: no tensor named 'y'
    """
