"""Tensor specs, the write plan and its one output loop."""
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

from .header import TensorInfo

MAX_ALIGN: Final[int]
"""The largest alignment the writers take (``align=``), in bytes: 1 MiB.

Examples
--------
>>> from fastst.writer import MAX_ALIGN
>>> MAX_ALIGN
1048576
"""

ALIGNED_HEADER_SPACES: Final[int]
"""The least number of spaces an aligned file's header ends in (8): more than the
format's own layout leaves, so that ``update_metadata`` keeps such a file aligned."""

class SupportsWrite(Protocol):
    def write(self, data: npt.NDArray[np.uint8], /) -> int | None: ...

class WriteSpec(NamedTuple):
    """One tensor to write: its name, header dtype code, header shape, and the
    array of its bytes.

    What every writer turns its input into (``spec_of_array`` for a NumPy
    array); given directly, it writes dtypes NumPy has no type for.

    Attributes
    ----------
    name : str
        The tensor's name.
    dtype : str
        Its header dtype code (see ``fastst.DTYPE_CODES``).
    shape : sequence of int
        Its header shape.
    data : numpy.ndarray or None
        An array whose bytes, in C order and little-endian, are the tensor's
        data: its dtype need not be the code's, only its byte count must
        match (four F4 values are two packed ``uint8``). None declares a
        tensor whose bytes are written later, in pieces (a streaming writer).

    Examples
    --------
    >>> import numpy as np, fastst
    >>> from fastst.writer import WriteSpec, serialize
    >>> packed = np.array([0x21, 0x43], dtype=np.uint8)     # four 4-bit floats
    >>> data = serialize([WriteSpec("f4", "F4", (4,), packed)])
    >>> fastst.load(data)["f4"]                              # F4 loads as packed bytes
    array([33, 67], dtype=uint8)
    """
    name: str
    dtype: str
    shape: Sequence[int]
    data: npt.NDArray[Any] | None

class WritePlan:
    """A file to write, as ``plan_write`` builds it: the 8-byte prefix and the
    padded header, then each tensor's place in the data, in the order the
    format's writers use (or, with ``align=``, the aligned order).

    Every writer of fastst writes through a plan: whole (`to_bytes`,
    `write_to`, `write_stream`), or, for a plan of declared tensors, the header
    first (`write_prefix`) and the tensors in pieces (`write_rows`,
    `write_bytes`).

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.writer import plan_write, spec_of_array
    >>> plan = plan_write([spec_of_array("x", np.zeros(2, np.float32))], None)
    >>> plan.names(), plan.data_start, plan.total_size
    (['x'], 64, 72)
    >>> plan.to_bytes()[8:plan.data_start]
    b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  '
    """
    @property
    def prefix(self) -> bytes:
        """The 8-byte header length and the header, padded with spaces."""
    @property
    def data(self) -> list[npt.NDArray[Any] | None]:
        """Each tensor's array, in file order (None for a declared tensor)."""
    @property
    def total_size(self) -> int:
        """The file's size in bytes."""
    def to_bytes(self) -> bytes:
        """The whole file as one bytes object, filled with the GIL released per
        tensor.

        Raises
        ------
        SafetensorError
            When the plan declares tensors without data.
        """
    def write_to(self, fd: int, target: str = "<file>") -> None:
        """Write the whole file to the open file descriptor `fd` (`target` names
        it in messages), the GIL released per write.

        Raises
        ------
        OSError
            When a write fails (a full disk).
        SafetensorError
            When the plan declares tensors without data.
        """
    def write_stream(self, stream: SupportsWrite, target: str = "<stream>") -> None:
        """Write the whole file to a binary file object, in order, through
        ``stream.write`` in pieces of at most 16 MiB: the bytes `write_to` writes,
        for uploads (fsspec files) and other file objects.

        Raises
        ------
        SafetensorError
            When the plan declares tensors without data.
        """
    @property
    def data_start(self) -> int:
        """Where the tensor data starts in the file: 8 + the header's length."""
    def write_prefix(self, fd: int, target: str = "<file>") -> None:
        """Write the prefix and header at the start of the file open as `fd`
        (a ``pwrite``: the file position does not move)."""
    def names(self) -> list[str]:
        """The tensor names, in file order."""
    def info(self, name: str, target: str = "<plan>") -> TensorInfo:
        """Tensor `name`'s header entry, as a reader's ``info`` gives it.

        Raises
        ------
        TensorNotFoundError
            When the plan has no tensor `name`.
        """
    def write_rows(
        self, fd: int, name: str, first_row: int, array: npt.NDArray[Any],
        target: str = "<file>", bits_of: str | None = None
    ) -> tuple[int, int]:
        """Write `array` as rows ``[first_row, first_row + len(array))`` of tensor
        `name`, at their place in the file open as `fd` (a ``pwrite``: the file
        position does not move).

        The array's dtype must be the tensor's NumPy dtype (either byte order),
        or, with `bits_of` (the header code of a dtype NumPy lacks, whose bits
        the array holds as integers of its width: a framework's bfloat16
        tensor), that code must be the tensor's; its rows of the tensor's row
        shape, every row within the tensor: all checked before a byte is
        written.

        Returns
        -------
        tuple of (int, int)
            The byte range written, relative to the tensor's start.

        Raises
        ------
        TensorNotFoundError
            When the plan has no tensor `name`.
        SafetensorError
            When the piece does not fit the tensor (its dtype:
            `SafetensorTypeError`).
        OSError
            When the write fails.
        """
    def write_bytes(
        self, fd: int, name: str, start: int, data: Buffer, target: str = "<file>"
    ) -> tuple[int, int]:
        """Write the bytes of `data` (any C-contiguous buffer) at byte `start` of
        tensor `name`: for dtypes the caller has no array type for.

        Returns
        -------
        tuple of (int, int)
            The byte range written, relative to the tensor's start.

        Raises
        ------
        TensorNotFoundError
            When the plan has no tensor `name`.
        SafetensorError
            When the bytes reach outside the tensor.
        OSError
            When the write fails.
        """

def spec_of_array(name: str, array: npt.ArrayLike) -> WriteSpec:
    """The `WriteSpec` that writes the NumPy array `array` as tensor `name`.

    The header code follows from the array's dtype (ml_dtypes' bfloat16 and
    float8 included); the array is taken as it is, not copied (a
    non-contiguous or big-endian one is converted as it is written).

    Parameters
    ----------
    name : str
        The tensor's name.
    array : numpy.ndarray
        Its data.

    Returns
    -------
    WriteSpec

    Raises
    ------
    TypeError
        When `name` is not a str or `array` not a NumPy array.
    SafetensorTypeError
        When the array's dtype has no safetensors code (strings, objects...).

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.writer import spec_of_array
    >>> spec_of_array("x", np.zeros((2, 3), np.float16))
    WriteSpec(name='x', dtype='F16', shape=(2, 3), data=array([[0., 0., 0.],
           [0., 0., 0.]], dtype=float16))
    """
def write_array_at(
    fd: int, array: npt.NDArray[Any], offset: int, target: str = ..., /
) -> None:
    """Write `array`'s bytes, in C order and little-endian, to `fd` at byte `offset`
    (a ``pwrite``, the GIL released): the writers' output loop, for a piece whose
    place the caller knows (a region of a file that other processes fill).

    Raises
    ------
    SafetensorError
        When `offset` is negative.
    OSError
        When the write fails.
    """
def plan_write(
    specs: Iterable[WriteSpec | tuple[str, str, Sequence[int], npt.NDArray[Any] | None]],
    metadata: Mapping[str, str] | None,
    *,
    header_padding: int = 0,
    header_size: int | None = None,
    keep_order: bool = False,
    align: int | None = None,
) -> WritePlan:
    """Check tensors to write, place them, and build the header: a `WritePlan`.

    The tensors are ordered as the format's writers order them (by dtype rank,
    descending, then by name) unless `keep_order`, and the header is the one
    the reference writes for them, byte for byte.

    With `align`, the header is padded with spaces so that the data starts at
    a multiple of `align` in the file, and (unless `keep_order`) the tensors
    are ordered so that as many as can start at a multiple of it too: first
    those whose size is a multiple of `align`; then groups, each led by the
    largest tensor left, followed by the fewest (at most three), smallest
    others whose sizes bring the group's end to a multiple of `align` (the
    format leaves no gap between tensors); then the tensors no group could
    close, largest first; then those whose size is not a multiple of 8, in
    the format's order, so that every tensor still starts at a multiple of
    its element's size. The format's order is kept where it aligns as many
    tensors. The order depends only on the tensors, not on the order they
    are given in; the header lists them in the order of their data.

    Parameters
    ----------
    specs : iterable of WriteSpec or (name, dtype, shape, data) tuples
        The tensors; a `data` left out or None declares one whose bytes come
        later.
    metadata : mapping of str to str or None
        The header's ``__metadata__``.
    header_padding : int, default 0
        Bytes of spaces reserved after the header (rounded so that the data
        stays 8-byte aligned), room for later metadata edits
        (``fastst.update_metadata``).
    header_size : int, optional
        A header of exactly this many bytes, padded with spaces: for rewriting
        a file's header in place.
    keep_order : bool, default False
        Place the tensors in the order given.
    align : int, optional
        A power of two from 1 to `MAX_ALIGN` (1 MiB), in bytes; None or 0
        for the format's layout.

    Returns
    -------
    WritePlan

    Raises
    ------
    SafetensorError
        When a name is given twice, a shape is not a list of unsigned
        integers, or a tensor's data has not the bytes its dtype and shape
        need; when the header does not fit in `header_size`, or
        ``8 + header_size`` is not a multiple of `align`; when `align` is
        not a power of two up to `MAX_ALIGN`.
    SafetensorTypeError
        When a dtype code is not known.
    TypeError
        When a name or a metadata key or value is not a str.

    Examples
    --------
    >>> from fastst.writer import plan_write
    >>> plan = plan_write([("b", "F32", (2,), None), ("a", "I8", (1,), None)], {"k": "v"})
    >>> plan.names(), plan.info("a")
    (['b', 'a'], TensorInfo(dtype='I8', shape=[1], data_offsets=(8, 9), array_shape=(1,)))

    Aligned to 64 bytes: the data starts at byte 192, and the 8 bytes of
    ``step`` fill the gap the 56 of ``b`` leave.

    >>> specs = [("w", "F32", (64,)), ("b", "F32", (14,)), ("step", "I64", ())]
    >>> plan = plan_write(specs, None, align=64)
    >>> plan.data_start, [(name, plan.info(name).data_offsets) for name in plan.names()]
    (192, [('w', (0, 256)), ('b', (256, 312)), ('step', (312, 320))])
    """
