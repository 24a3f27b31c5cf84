# Writing: every writer hands over explicit specs; one plan, one output loop
# (included by _core.pyx).

TensorSpec = namedtuple("TensorSpec", ["name", "dtype", "shape", "source"])
TensorSpec.__doc__ = """One tensor to write: its name, header dtype code, header shape, and
`source`, a NumPy array whose bytes (in C order, little-endian) are the tensor's data.
The source's dtype need not be the code's: torch float4 comes as packed uint8."""


cdef int _code_for_array(str name, object array) except -1:
    dtype = array.dtype
    _numpy_dtypes()
    code = _CODE_OF_NUMPY_NAME.get(dtype.name)
    if code is None or dtype.fields is not None:
        if dtype.hasobject:
            raise SafetensorTypeError(f"tensor {_shown(name)}: object arrays cannot be saved")
        raise SafetensorTypeError(
            f"tensor {_shown(name)}: dtype {dtype} has no safetensors code (supported: "
            f"{', '.join(sorted(_CODE_OF_NUMPY_NAME))})")
    return code


def spec_of_array(name, array):
    """The TensorSpec that writes NumPy `array` as tensor `name`."""
    if type(name) is not str:
        raise TypeError(f"tensor names must be str, got {type(name).__name__} {_shown(name)}")
    if isinstance(array, np.generic):
        array = np.asarray(array)
    elif not isinstance(array, np.ndarray):
        raise TypeError(f"tensor {_shown(name)}: expected a numpy.ndarray, got "
                        f"{type(array).__module__}.{type(array).__qualname__}")
    return TensorSpec(name, DTYPE_CODES[_code_for_array(name, array)], array.shape, array)


cdef class WritePlan:
    """A file to write: the 8-byte prefix and padded header, then the sources in
    the order the format's writers use (dtype rank descending, then name)."""
    cdef readonly bytes prefix
    cdef readonly list sources
    cdef readonly uint64_t total_size

    def to_bytes(self):
        """The whole file as one bytes object, filled with the GIL released per tensor."""
        cdef bytes out = PyBytes_FromStringAndSize(NULL, self.total_size)
        self._output(PyBytes_AS_STRING(out), -1, "<bytes>")
        return out

    def write_to(self, int fd, str target="<file>"):
        """Write the whole file to `fd`, the GIL released per write."""
        self._output(NULL, fd, target)

    cdef _output(self, char* dest, int fd, str target):
        """The one output loop: each piece goes to `dest` (advancing) when it is
        given, else to `fd`."""
        dest = _emit(dest, fd, PyBytes_AS_STRING(self.prefix), len(self.prefix), target)
        cdef cnp.ndarray array
        for item in self.sources:
            if _is_transposed_matrix(item):
                _transpose_into(item, dest, fd, target)
                if dest != NULL:
                    dest += cnp.PyArray_NBYTES(<cnp.ndarray>item)
                continue
            array = _little_endian_c_order(item)
            dest = _emit(dest, fd, <char*>cnp.PyArray_DATA(array), cnp.PyArray_NBYTES(array),
                         target)
            array = None


cdef char* _emit(char* dest, int fd, const char* data, size_t length, str target) except? NULL:
    """Copy `length` bytes to `dest` and return the position after them, or write
    them to `fd` (dest NULL) and return NULL."""
    if dest == NULL:
        _write_all_or_raise(fd, data, length, target)
        return NULL
    with nogil:
        memcpy(dest, data, length)
    return dest + length


def plan_write(specs, object metadata):
    """Validate TensorSpecs (or 4-tuples of the same fields), order them as the
    format's writers do, and build the header: a WritePlan."""
    entries = []
    seen = set()
    for spec in specs:
        name, code, shape, source = spec
        rank = _checked_spec(name, code, shape, source, seen)
        entries.append((-rank, name, tuple([int(dim) for dim in shape]), source))
    entries.sort(key=_rank_and_name)

    header = {}
    if metadata is not None:
        header["__metadata__"] = _checked_metadata(metadata)
    cdef uint64_t offset = 0
    sources = []
    for rank, name, shape, source in entries:
        nbytes = source.nbytes
        header[name] = {"dtype": DTYPE_CODES[-rank], "shape": shape,
                        "data_offsets": (offset, offset + nbytes)}
        offset += nbytes
        sources.append(source)
    cdef WritePlan plan = WritePlan.__new__(WritePlan)
    plan.prefix = _prefix_and_header(header)
    plan.sources = sources
    plan.total_size = len(plan.prefix) + offset
    return plan


cdef int _checked_spec(object name, object code, object shape, object source,
                       set seen) except -1:
    """The rank of a valid spec's dtype; raises when the spec is not valid."""
    if type(name) is not str:
        raise TypeError(f"tensor names must be str, got {type(name).__name__} {_shown(name)}")
    if name == "__metadata__":
        raise ValueError("'__metadata__' is reserved for the header's metadata and cannot "
                         "name a tensor")
    if name in seen:
        raise ValueError(f"tensor {_shown(name)} is given twice")
    seen.add(name)
    rank = _CODE_OF_NAME.get(code) if type(code) is str else None
    if rank is None:
        raise SafetensorTypeError(f"tensor {_shown(name)}: unknown dtype code {_shown(code)} "
                                  f"(known: {', '.join(DTYPE_CODES)})")
    if not isinstance(source, np.ndarray):
        raise TypeError(f"tensor {_shown(name)}: the source must be a numpy.ndarray, got "
                        f"{type(source).__name__}")
    cdef uint64_t count = 1, dim, nbytes
    for value in shape:
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                or not 0 <= value <= UINT64_MAX):
            raise ValueError(f"tensor {_shown(name)}: shape must hold unsigned integers, got "
                             f"{_shown(shape)}")
        dim = value
        if fastst_mul_overflow(count, dim, &count):
            raise ValueError(f"tensor {_shown(name)}: element count of shape {_shown(shape)} overflows 64 bits")
    cdef int status = fastst_packed_bytes(count, BITS[<int>rank], &nbytes)
    if status < 0:
        raise ValueError(f"tensor {_shown(name)}: {count} elements of {code} ({BITS[<int>rank]} "
                         f"bits each) do not fill whole bytes")
    if status > 0 or nbytes != <uint64_t>source.nbytes:
        raise ValueError(f"tensor {_shown(name)}: shape {_shown(list(shape))} x {code} needs {nbytes} bytes "
                         f"but the source holds {source.nbytes}")
    return rank


cdef bytes _prefix_and_header(dict header):
    import orjson
    try:
        text = orjson.dumps(header)
    except TypeError as error:   # e.g. a name with a lone surrogate
        raise ValueError(f"header cannot be written as UTF-8 JSON: {error}") from None
    cdef Py_ssize_t padded = (len(text) + 7) // 8 * 8
    if padded > DEFAULT_MAX_HEADER_SIZE:
        raise ValueError(f"header of {padded} bytes exceeds the format's limit of "
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


cdef _transpose_into(cnp.ndarray array, char* dest, int fd, str target):
    """C-ordered bytes of a Fortran-ordered matrix: into `dest` when given, else
    block by block through a small buffer to `fd`."""
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
                _write_all_or_raise(fd, buffer, rows * row_bytes, target)
    finally:
        if dest == NULL:
            free(buffer)


cdef _write_all_or_raise(int fd, const char* data, size_t length, str target):
    cdef int error = 0
    cdef ssize_t written
    cdef size_t chunk
    with nogil:
        while length > 0:
            chunk = length if length < (<size_t>1 << 30) else (<size_t>1 << 30)
            written = write(fd, data, chunk)
            if written < 0:
                if errno == EINTR:
                    continue
                error = errno
                break
            data += written
            length -= written
    if error:
        raise OSError(error, os.strerror(error), target)
