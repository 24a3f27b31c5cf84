# Writing: every writer hands over explicit specs; one plan, one output loop
# (included by __init__.pyx).

cdef dict _CODE_OF_DTYPE = {}     # dtypes seen, by themselves: dtype.name is slow to make


cdef int _code_for_array(str name, object array) except -1:
    dtype = array.dtype
    code = _CODE_OF_DTYPE.get(dtype)
    if code is not None:
        return code
    code = _CODE_OF_NUMPY_NAME.get(dtype.name)
    if code is None or dtype.fields is not None:
        if dtype.hasobject:
            raise SafetensorTypeError(f"tensor {_shown(name)}: object arrays cannot be saved")
        raise SafetensorTypeError(
            f"tensor {_shown(name)}: dtype {dtype} has no safetensors code (supported: "
            f"{', '.join(sorted(_CODE_OF_NUMPY_NAME))})")
    _CODE_OF_DTYPE[dtype] = code
    return code


def spec_of_array(name, array):
    """The `WriteSpec` that writes the NumPy array `array` as tensor `name`."""
    if type(name) is not str:
        raise TypeError(f"tensor names must be str, got {type(name).__name__} {_shown(name)}")
    if isinstance(array, np.generic):
        array = np.asarray(array)
    elif not isinstance(array, np.ndarray):
        raise TypeError(f"tensor {_shown(name)}: expected a numpy.ndarray, got "
                        f"{type(array).__module__}.{type(array).__qualname__}")
    return _record("WriteSpec")(name, DTYPE_CODES[_code_for_array(name, array)], array.shape,
                                  array)


cdef class WritePlan:
    """A file to write, as ``plan_write`` builds it: the 8-byte prefix and the
    padded header, then each tensor's place in the data, in the order the
    format's writers use (or, with ``align=``, the aligned order)."""
    cdef readonly bytes prefix
    """The 8-byte header length and the header, padded with spaces."""
    cdef readonly list data
    """Each tensor's array, in file order (None for a declared tensor)."""
    cdef readonly uint64_t total_size
    """The file's size in bytes."""
    cdef _Header layout       # the plan's own header parsed back, on first use

    def to_bytes(self):
        """The whole file as one bytes object, filled with the GIL released per
        tensor."""
        self._check_data()
        cdef bytes out = PyBytes_FromStringAndSize(NULL, self.total_size)
        self._output(PyBytes_AS_STRING(out), -1, "<bytes>")
        return out

    def write_to(self, int fd, str target="<file>"):
        """Write the whole file to the open file descriptor `fd` (`target` names
        it in messages), the GIL released per write."""
        self._check_data()
        self._output(NULL, fd, target)

    def write_stream(self, stream, str target="<stream>"):
        """Write the whole file to a binary file object, in order, through
        ``stream.write`` in pieces of at most 16 MiB: the bytes `write_to` writes,
        for uploads (fsspec files) and other file objects."""
        self._check_data()
        _write_pieces(stream, np.frombuffer(self.prefix, np.uint8), target)
        for item in self.data:
            _write_pieces(stream, _little_endian_c_order(item), target)

    cdef _check_data(self):
        for item in self.data:
            if item is None:
                raise SafetensorError("a plan of declared tensors has no data to write "
                                      "whole; fill it with write_rows or write_bytes")

    cdef _output(self, char* dest, int fd, str target):
        """The one output loop: each piece goes to `dest` (advancing) when it is
        given, else to `fd` at its position, gathered into few writes (_Gather)."""
        if dest == NULL:
            self._write_gathered(fd, target)
            return
        dest = _emit(dest, fd, -1, PyBytes_AS_STRING(self.prefix), len(self.prefix), target)
        for item in self.data:
            dest = _emit_array(item, dest, fd, -1, target)

    cdef _write_gathered(self, int fd, str target):
        cdef _Gather gather = _Gather(fd, target)
        gather.add(self.prefix, PyBytes_AS_STRING(self.prefix), len(self.prefix))
        for item in self.data:
            if _is_transposed_matrix(item):
                gather.flush()
                _transpose_into(item, NULL, fd, -1, target)
                continue
            array = _little_endian_c_order(item)
            gather.add(array, <char*>cnp.PyArray_DATA(array), cnp.PyArray_NBYTES(array))
        gather.flush()

    @property
    def data_start(self):
        """Where the tensor data starts in the file: 8 + the header's length."""
        return len(self.prefix)

    def write_prefix(self, int fd, str target="<file>"):
        """Write the prefix and header at the start of the file open as `fd`
        (a ``pwrite``: the file position does not move)."""
        _emit(NULL, fd, 0, PyBytes_AS_STRING(self.prefix), len(self.prefix), target)

    def names(self):
        """The tensor names, in file order."""
        return list(self._layout().names)

    def info(self, name, str target="<plan>"):
        """Tensor `name`'s header entry, as a reader's ``info`` gives it."""
        cdef _Header h = self._layout()
        cdef Py_ssize_t i = self._position(name, target)
        cdef Entry* entry = &h.entries[i]
        return _record("TensorInfo")(DTYPE_CODES[entry.code], h.shape(i),
                                     (entry.begin, entry.end), _array_shape(h, entry))

    def write_rows(self, int fd, name, first_row, array, str target="<file>",
                   str bits_of=None):
        """Write `array` as rows ``[first_row, first_row + len(array))`` of tensor
        `name`, at their place in the file open as `fd` (a ``pwrite``: the file
        position does not move)."""
        cdef _Header h = self._layout()
        cdef Py_ssize_t i = self._position(name, target)
        cdef Entry* entry = &h.entries[i]
        if not isinstance(array, np.ndarray):
            raise SafetensorTypeError(f"{target}: tensor {_shown(name)}: expected a "
                                      f"numpy.ndarray, got {type(array).__name__}")
        if bits_of is None:
            _check_piece_dtype(target, name, entry.code, array.dtype)
        else:
            _check_piece_bits(target, name, entry.code, bits_of, array.dtype)
        shape = _array_shape(h, entry)
        if shape is None:
            raise SafetensorError(f"{target}: tensor {_shown(name)}: shape "
                                  f"{_shown(h.shape(i))} cannot be a NumPy array; write "
                                  f"its bytes with write_bytes")
        first, rows = _checked_rows(target, name, shape, array.shape, first_row)
        cdef uint64_t size = entry.end - entry.begin
        if not shape:
            return self._write_at(fd, entry, 0, array, size, target)
        cdef uint64_t row_bytes = size // shape[0] if shape[0] else 0
        return self._write_at(fd, entry, first * row_bytes, array, rows * row_bytes, target)

    def write_bytes(self, int fd, name, object start, data, str target="<file>"):
        """Write the bytes of `data` (any C-contiguous buffer) at byte `start` of
        tensor `name`: for dtypes the caller has no array type for."""
        cdef _Header h = self._layout()
        cdef Entry* entry = &h.entries[self._position(name, target)]
        try:
            view = memoryview(data)
        except TypeError:
            raise SafetensorTypeError(f"{target}: tensor {_shown(name)}: expected a buffer "
                                      f"of bytes, got {type(data).__name__}") from None
        if not view.c_contiguous:
            raise SafetensorError(f"{target}: tensor {_shown(name)}: the bytes must be "
                                  f"C-contiguous")
        first = _checked_position(target, name, "start", start)
        cdef uint64_t size = entry.end - entry.begin, length = view.nbytes
        if first > size or length > size - first:
            raise SafetensorIndexError(
                f"{target}: tensor {_shown(name)}: bytes [{first}, {first + length}) lie "
                f"outside its {size} bytes")
        array = np.frombuffer(view.cast("B"), dtype=np.uint8)
        return self._write_at(fd, entry, first, array, length, target)

    cdef tuple _write_at(self, int fd, Entry* entry, uint64_t start, cnp.ndarray array,
                         uint64_t length, str target):
        if length:
            _emit_array(array, NULL, fd, self.data_start + entry.begin + start, target)
        return start, start + length

    cdef _Header _layout(self):
        if self.layout is None:
            self.layout = parse_header(self.prefix[8:], "<plan>",
                                       self.total_size - len(self.prefix))
        return self.layout

    cdef Py_ssize_t _position(self, name, str target="<plan>") except -1:
        position = self._layout().index().get(name)
        if position is None:
            raise TensorNotFoundError(f"{target}: no tensor named {_shown(name)} was declared")
        return position


cdef object _array_shape(_Header h, Entry* entry):
    if entry.np_ndim < 0:
        return None
    cdef cnp.npy_intp* dims = h.numpy_dims(entry)
    return tuple([dims[k] for k in range(entry.np_ndim)])


cdef _check_piece_dtype(str target, object name, int code, object dtype):
    cdef str expected = _numpy_name(code)
    if dtype.name == expected:   # so a piece of ml_dtypes' dtype has imported it already
        wanted = _numpy_dtype_of(code)
        if dtype == wanted or (dtype.byteorder == ">" and dtype.newbyteorder("<") == wanted):
            return
    raise SafetensorTypeError(f"{target}: tensor {_shown(name)} is {DTYPE_CODES[code]}: its "
                              f"pieces must be {expected} arrays, got {dtype}")


cdef _check_piece_bits(str target, object name, int code, str bits_of, object dtype):
    """A piece that holds the bits of dtype `bits_of` (an unsigned integer of its
    width) fits a tensor of that dtype alone."""
    cdef int piece_code = _code_of_name(bits_of)
    if piece_code != code or dtype.kind not in "ui" or dtype.itemsize * 8 != BITS[code]:
        raise SafetensorTypeError(
            f"{target}: tensor {_shown(name)} is {DTYPE_CODES[code]}: its pieces must be "
            f"{_numpy_name(code)} arrays, got {_numpy_name(piece_code)}")


cdef tuple _checked_rows(str target, object name, tuple shape, tuple piece, object first_row):
    """(first row, row count) of a piece of shape `piece` written at `first_row` of
    a tensor whose NumPy shape is `shape`; raises when it does not fit."""
    first_row = _checked_position(target, name, "start_row", first_row)
    if not shape:
        if piece or first_row:
            raise SafetensorError(f"{target}: tensor {_shown(name)} is 0-d: write it whole, "
                                  f"a 0-d array at row 0 (got shape {piece} at row "
                                  f"{first_row})")
        return 0, 1
    if len(piece) != len(shape) or piece[1:] != shape[1:]:
        raise SafetensorError(f"{target}: tensor {_shown(name)} has shape {shape}: a piece "
                              f"must have shape (rows,) + {shape[1:]}, got {piece}")
    if first_row > shape[0] - piece[0]:
        raise SafetensorIndexError(f"{target}: tensor {_shown(name)}: rows [{first_row}, "
                                   f"{first_row + piece[0]}) lie outside its {shape[0]} rows")
    return first_row, piece[0]


cdef object _checked_position(str target, object name, str what, object value):
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or value < 0):
        raise SafetensorError(f"{target}: tensor {_shown(name)}: {what} must be an integer "
                              f">= 0, got {_shown(value)}")
    return int(value)


def write_array_at(int fd, cnp.ndarray array not None, int64_t offset, str target="<file>"):
    """Write `array`'s bytes, in C order and little-endian, to `fd` at byte `offset`
    (a ``pwrite``, the GIL released): the writers' output loop, for a piece whose
    place the caller knows (a region of a file that other processes fill)."""
    if offset < 0:
        raise SafetensorError(f"{target}: offset must be >= 0, got {offset}")
    _emit_array(array, NULL, fd, offset, target)


cdef char* _emit_array(cnp.ndarray item, char* dest, int fd, int64_t offset,
                       str target) except? NULL:
    """Array `item`'s bytes, in C order and little-endian, copied to `dest` (the
    position after them is returned) or written to `fd` (dest NULL): at `offset`
    when it is >= 0, else at the file's position. Every writer's data passes here."""
    if _is_transposed_matrix(item):
        _transpose_into(item, dest, fd, offset, target)
        return dest + cnp.PyArray_NBYTES(item) if dest != NULL else NULL
    cdef cnp.ndarray array = _little_endian_c_order(item)
    return _emit(dest, fd, offset, <char*>cnp.PyArray_DATA(array), cnp.PyArray_NBYTES(array),
                 target)


cdef char* _emit(char* dest, int fd, int64_t offset, const char* data, size_t length,
                 str target) except? NULL:
    """Copy `length` bytes to `dest` and return the position after them, or write
    them to `fd` (dest NULL) and return NULL."""
    if dest == NULL:
        _write_all_or_raise(fd, data, length, offset, target)
        return NULL
    with nogil:
        memcpy(dest, data, length)
    return dest + length


cdef enum:
    GATHER_PIECES = 1024            # IOV_MAX on Linux and macOS: pieces one writev takes
cdef size_t GATHER_BYTES = 4 << 20  # a gather is written once it holds this many bytes


cdef class _Gather:
    """Pieces of memory to write to a file at its position, in order, gathered into
    writev calls of up to GATHER_PIECES pieces and about GATHER_BYTES bytes: 20,000
    small tensors take a few hundred calls rather than 20,000, and no piece is
    copied to be gathered. A piece of more than 1 GiB is cut into pieces of 1 GiB,
    so that no call asks for more than a platform takes at once (2 GiB on macOS)."""
    cdef iovec pieces[GATHER_PIECES]
    cdef int count
    cdef size_t size
    cdef list held        # the objects whose memory the pieces point into
    cdef int fd
    cdef str target

    def __cinit__(self, int fd, str target):
        self.fd, self.target, self.held = fd, target, []

    cdef add(self, object owner, char* data, size_t length):
        """Add `length` bytes at `data`, memory of `owner`: written by the time the
        gather is flushed."""
        cdef size_t piece
        if length:
            self.held.append(owner)
        while length:
            piece = length if length < (<size_t>1 << 30) else (<size_t>1 << 30)
            self.pieces[self.count].iov_base = data
            self.pieces[self.count].iov_len = piece
            self.count += 1
            self.size += piece
            data += piece
            length -= piece
            if self.count == GATHER_PIECES or self.size >= GATHER_BYTES:
                self.flush()
                if length:
                    self.held.append(owner)

    cdef flush(self):
        """Write the pieces gathered, the GIL released."""
        cdef int error
        if self.count == 0:
            return
        with nogil:
            error = _writev_all(self.fd, self.pieces, self.count)
        self.count, self.size, self.held = 0, 0, []
        if error:
            raise OSError(error, os.strerror(error), self.target)


cdef int _writev_all(int fd, iovec* pieces, int count) noexcept nogil:
    """writev() every byte of `pieces` at the file's position, continuing a short
    write where it stopped: 0, or the errno of the call that failed (EIO for one
    that wrote nothing)."""
    cdef ssize_t written
    while count > 0:
        written = writev(fd, pieces, count)
        if written < 0:
            if errno == EINTR:
                continue
            return errno
        if written == 0:        # a file that takes nothing would be asked forever
            return EIO
        while count > 0 and <size_t>written >= pieces[0].iov_len:
            written -= pieces[0].iov_len
            pieces += 1
            count -= 1
        if count > 0:
            pieces[0].iov_base = <char*>pieces[0].iov_base + written
            pieces[0].iov_len -= written
    return 0


cdef Py_ssize_t STREAM_PIECE = 16 << 20


cdef _write_pieces(object stream, cnp.ndarray array, str target):
    """A C-ordered array's bytes to stream.write, piece by piece; a short write is
    continued, a write that takes nothing is an error."""
    cdef object data = array.reshape(-1).view(np.uint8)
    cdef Py_ssize_t done = 0, size = data.shape[0]
    while done < size:
        piece = data[done:done + STREAM_PIECE]
        written = stream.write(piece)
        if written is None:
            written = piece.shape[0]
        if not 0 < written <= piece.shape[0]:
            raise OSError(f"{target}: the stream took {written} of {piece.shape[0]} bytes")
        done += written


def plan_write(specs, object metadata, *, header_padding=0, header_size=None,
               bint keep_order=False, align=None):
    """Check tensors to write, place them, and build the header: a `WritePlan`."""
    cdef Py_ssize_t alignment = _checked_align(align)
    entries = []
    seen = set()
    for spec in specs:
        name, code, shape, data = _spec_fields(spec)
        rank, nbytes = _checked_spec(name, code, shape, data, seen)
        entries.append((-rank, name, tuple([int(dim) for dim in shape]), data, nbytes))
    if not keep_order:
        entries.sort(key=_rank_and_name)
        if alignment > 1:
            entries = _aligned_order(entries, alignment)

    header = {}
    if metadata is not None:
        header["__metadata__"] = _checked_metadata(metadata)
    cdef uint64_t offset = 0
    arrays = []
    for rank, name, shape, data, nbytes in entries:
        header[name] = {"dtype": DTYPE_CODES[-rank], "shape": shape,
                        "data_offsets": (offset, offset + nbytes)}
        offset += nbytes
        arrays.append(data)
    cdef WritePlan plan = WritePlan.__new__(WritePlan)
    plan.prefix = _prefix_and_header(header, _checked_size("header_padding", header_padding),
                                     -1 if header_size is None
                                     else _checked_size("header_size", header_size),
                                     alignment)
    plan.data = arrays
    plan.total_size = len(plan.prefix) + offset
    return plan


cdef tuple _spec_fields(object spec):
    """(name, code, shape, data) of a WriteSpec, a 4-tuple, or a 3-tuple that
    declares a tensor without its data."""
    fields = tuple(spec) if isinstance(spec, (tuple, list)) else None
    if fields is None or not 3 <= len(fields) <= 4:
        raise SafetensorTypeError(f"a spec is (name, dtype code, shape[, data]), got "
                                  f"{_shown(fields) if fields is not None else type(spec).__name__}")
    return fields if len(fields) == 4 else fields + (None,)


cdef Py_ssize_t _checked_size(str what, object value) except -1:
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or not 0 <= value <= DEFAULT_MAX_HEADER_SIZE):
        raise SafetensorError(f"{what} must be an integer from 0 to "
                              f"{DEFAULT_MAX_HEADER_SIZE}, got {_shown(value)}")
    return value


cdef tuple _checked_spec(object name, object code, object shape, object data, set seen):
    """(rank of the dtype, byte size) of a valid spec; raises when it is not valid."""
    if type(name) is not str:
        raise TypeError(f"tensor names must be str, got {type(name).__name__} {_shown(name)}")
    if name == "__metadata__":
        raise SafetensorError("'__metadata__' is reserved for the header's metadata and "
                              "cannot name a tensor")
    if name in seen:
        raise SafetensorError(f"tensor {_shown(name)} is given twice")
    seen.add(name)
    rank = _CODE_OF_NAME.get(code) if type(code) is str else None
    if rank is None:
        raise SafetensorTypeError(f"tensor {_shown(name)}: unknown dtype code {_shown(code)} "
                                  f"(known: {', '.join(DTYPE_CODES)})")
    if data is not None and not isinstance(data, np.ndarray):
        raise TypeError(f"tensor {_shown(name)}: the data must be a numpy.ndarray, got "
                        f"{type(data).__name__}")
    cdef uint64_t count = 1, dim, nbytes
    try:
        dims = list(shape)
    except TypeError:
        raise SafetensorTypeError(f"tensor {_shown(name)}: shape must be a sequence of "
                                  f"integers, got {type(shape).__name__}") from None
    if len(dims) > MAX_DIMS:
        raise SafetensorError(f"tensor {_shown(name)}: {len(dims)} dimensions, more than "
                              f"{MAX_DIMS}")
    for value in dims:
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                or not 0 <= value <= UINT64_MAX):
            raise SafetensorError(f"tensor {_shown(name)}: shape must hold unsigned integers, "
                                  f"got {_shown(dims)}")
        dim = value
        if fastst_mul_overflow(count, dim, &count):
            raise SafetensorError(f"tensor {_shown(name)}: element count of shape "
                                  f"{_shown(dims)} overflows 64 bits")
    cdef int status = fastst_packed_bytes(count, BITS[<int>rank], &nbytes)
    if status < 0:
        raise SafetensorError(f"tensor {_shown(name)}: {count} elements of {code} "
                              f"({BITS[<int>rank]} bits each) do not fill whole bytes")
    if status > 0:
        raise SafetensorError(f"tensor {_shown(name)}: shape {_shown(dims)} x {code} "
                              f"overflows 64 bits of bytes")
    if data is not None and nbytes != <uint64_t>data.nbytes:
        raise SafetensorError(f"tensor {_shown(name)}: shape {_shown(dims)} x {code} needs "
                              f"{nbytes} bytes but the data holds {data.nbytes}")
    return rank, nbytes


cdef bytes _prefix_and_header(dict header, Py_ssize_t padding, Py_ssize_t exact_size,
                              Py_ssize_t align):
    """The 8-byte length and the header, padded with spaces so that the data starts
    at a multiple of 8 and of `align`, `padding` spaces at least (or to exactly
    `exact_size` bytes)."""
    from fastst._json import dumps
    try:
        text = dumps(header)
    except TypeError as error:   # e.g. a name with a lone surrogate
        raise SafetensorError(f"header cannot be written as UTF-8 JSON: {error}") from None
    cdef Py_ssize_t unit = max(align, 8)
    if align > 8:   # an aligned header ends in 8 spaces or more: see ALIGNED_HEADER_SPACES
        padding = max(padding, ALIGNED_HEADER_SPACES)
    cdef Py_ssize_t padded = (8 + len(text) + padding + unit - 1) // unit * unit - 8
    if exact_size >= 0:
        if len(text) > exact_size:
            raise SafetensorError(f"header of {len(text)} bytes does not fit in "
                                  f"{exact_size} bytes")
        if align and (8 + exact_size) % align:
            raise SafetensorError(f"a header of {exact_size} bytes cannot start the data "
                                  f"at a multiple of {align}")
        padded = exact_size
    if padded > DEFAULT_MAX_HEADER_SIZE:
        raise SafetensorError(f"header of {padded} bytes exceeds the format's limit of "
                              f"{DEFAULT_MAX_HEADER_SIZE}")
    return (<uint64_t>padded).to_bytes(8, "little") + text + b" " * (padded - len(text))


def _rank_and_name(entry):
    return entry[0], entry[1]


cdef dict _checked_metadata(object metadata):
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if type(key) is not str or type(value) is not str:
            raise TypeError(f"metadata must map str to str, got {_shown(key)}: {_shown(value)}")
    return {key: metadata[key] for key in sorted(metadata)}


cdef cnp.ndarray _little_endian_c_order(object array):
    """The array itself when its bytes can be written as they are, else a C-ordered,
    little-endian copy of this one tensor."""
    dtype = array.dtype
    if dtype.byteorder == ">":
        array = array.astype(dtype.newbyteorder("<"), order="C")
    elif not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


cdef bint _is_transposed_matrix(cnp.ndarray array):
    """A Fortran-ordered little-endian matrix (a transposed weight, typically):
    written by transposing blocks of rows, which is fast and needs no full copy."""
    return (cnp.PyArray_NDIM(array) == 2 and not cnp.PyArray_IS_C_CONTIGUOUS(array)
            and cnp.PyArray_IS_F_CONTIGUOUS(array) and array.dtype.byteorder != ">"
            and array.dtype.itemsize in (1, 2, 4, 8))


cdef Py_ssize_t _rows_per_block(Py_ssize_t rows, Py_ssize_t row_bytes) noexcept:
    # About 8 MiB a block: each visit to a column (a page apart from the next one)
    # then reads a long run of it. At least 16 rows, so a visit spans cache lines.
    cdef Py_ssize_t block = (8 << 20) // row_bytes if row_bytes else rows
    return min(rows, max(block, 16))


cdef _transpose_into(cnp.ndarray array, char* dest, int fd, int64_t offset, str target):
    """C-ordered bytes of a Fortran-ordered matrix: into `dest` when given, else
    block by block through a small buffer to `fd` (at `offset` when it is >= 0)."""
    cdef Py_ssize_t m = cnp.PyArray_DIM(array, 0), n = cnp.PyArray_DIM(array, 1)
    cdef int itemsize = cnp.PyArray_ITEMSIZE(array)
    cdef Py_ssize_t row_bytes = n * itemsize
    cdef Py_ssize_t block = _rows_per_block(m, row_bytes), row0, rows
    cdef const char* src = <const char*>cnp.PyArray_DATA(array)
    cdef char* buffer = dest
    if dest == NULL:
        buffer = <char*>malloc(block * row_bytes if block * row_bytes else 1)
        if buffer == NULL:
            raise MemoryError()
    try:
        for row0 in range(0, m, block):
            rows = min(block, m - row0)
            with nogil:
                fastst_transpose_rows(src, buffer if dest == NULL else dest + row0 * row_bytes,
                                      m, n, row0, rows, itemsize)
            if dest == NULL:
                _write_all_or_raise(fd, buffer, rows * row_bytes,
                                    offset + row0 * row_bytes if offset >= 0 else -1, target)
    finally:
        if dest == NULL:
            free(buffer)


cdef _write_all_or_raise(int fd, const char* data, size_t length, int64_t offset, str target):
    """write() every byte at the file's position, or pwrite() them at `offset`
    when it is >= 0; the GIL released. A call that writes nothing fails with EIO."""
    cdef int error = 0
    cdef ssize_t written
    cdef size_t chunk
    with nogil:
        while length > 0:
            chunk = length if length < (<size_t>1 << 30) else (<size_t>1 << 30)
            if offset >= 0:
                written = pwrite(fd, data, chunk, offset)
            else:
                written = write(fd, data, chunk)
            if written < 0:
                if errno == EINTR:
                    continue
                error = errno
                break
            if written == 0:    # a file that takes nothing would be asked forever
                error = EIO
                break
            data += written
            length -= written
            if offset >= 0:
                offset += written
    if error:
        raise OSError(error, os.strerror(error), target)
