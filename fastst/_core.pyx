# cython: language_level=3
"""The byte-level core of fastst: header decoding and validation, the memory map,
zero-copy array views, and writes straight from array buffers.

Everything here validates before it trusts: no view exists until the whole header has
been checked against the file's size.
"""
import os
import stat
from collections.abc import Mapping

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS, PyBUF_WRITABLE, PyBuffer_FillInfo, PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.errno cimport EINTR, errno
from libc.stdint cimport UINT64_MAX, uint8_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy
from posix.mman cimport MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap
from posix.types cimport off_t
from posix.unistd cimport pread, write

cnp.import_array()

cdef extern from "Python.h":
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    void* PyUnicode_DATA(object text)

cdef extern from "numpy/arrayobject.h":
    ctypedef struct Descr "PyArray_Descr":
        pass
    PyTypeObject PyArray_Type
    # Both steal the reference to descr.
    object PyArray_Empty(int nd, cnp.npy_intp* dims, Descr* descr, int fortran)
    object PyArray_NewFromDescr(PyTypeObject* subtype, Descr* descr, int nd,
                                cnp.npy_intp* dims, cnp.npy_intp* strides, void* data,
                                int flags, PyObject* obj)

cdef extern from *:
    """
    static inline int fastst_mul_overflow(uint64_t a, uint64_t b, uint64_t *out) {
        return __builtin_mul_overflow(a, b, out);
    }
    /* Bytes of `count` elements of `bits` bits: 0 on success, -1 when they do not fill
       whole bytes, 1 when the byte count overflows 64 bits. */
    static inline int fastst_packed_bytes(uint64_t count, unsigned bits, uint64_t *out) {
        unsigned __int128 total = (unsigned __int128)count * bits;
        if (total % 8) return -1;
        total /= 8;
        if (total > UINT64_MAX) return 1;
        *out = (uint64_t)total;
        return 0;
    }
    /* The header dtype codes, numbered in the order of the reference's Dtype enum:
       its writer sorts by that order (descending), so the number doubles as rank. */
    static const char *const fastst_codes[22] = {
        "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
        "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
        "C64", "F64", "I64", "U64"};
    static const unsigned char fastst_code_lengths[22] = {
        4, 2, 7, 7, 2, 2, 7, 7, 7, 11, 11, 3, 3, 3, 4, 3, 3, 3, 3, 3, 3, 3};
    static inline int fastst_code_of(const char *text, Py_ssize_t length) {
        for (int code = 21; code >= 0; code--) {   /* wide dtypes are the common ones */
            if (fastst_code_lengths[code] == length && text[0] == fastst_codes[code][0]
                    && memcmp(fastst_codes[code], text, length) == 0)
                return code;
        }
        return -1;
    }
    /* End (index of the closing quote) of a JSON string whose text starts at `pos`;
       -1 when it is unterminated or holds an escape or a control character.
       `*ascii` tells whether every byte was ASCII. The scan has no early exit, so
       the compiler vectorizes it. */
    static inline Py_ssize_t fastst_string_end(const unsigned char *p, Py_ssize_t pos,
                                               Py_ssize_t n, int *ascii) {
        const unsigned char *quote = memchr(p + pos, '"', (size_t)(n - pos));
        if (quote == NULL) return -1;
        Py_ssize_t end = quote - p;
        unsigned char bad = 0, high = 0;
        for (Py_ssize_t i = pos; i < end; i++) {
            unsigned char ch = p[i];
            bad |= (unsigned char)((ch == 92) | (ch < 32));
            high |= ch;
        }
        if (bad) return -1;
        *ascii = high < 128;
        return end;
    }
    /* Rows [row0, row0 + rows) of an m x n matrix stored in Fortran order at `src`,
       written in C order to `dst`. Tiles of 16 columns: each output row is written
       in runs of 16, and the 16 columns being read stay in cache and in the TLB while
       consecutive rows walk down them. Loads and stores go through memcpy, which
       compiles to plain moves and tolerates unaligned arrays. */
    #define FASTST_TRANSPOSE(T) {                                                  \
        const Py_ssize_t size = (Py_ssize_t)sizeof(T);                            \
        for (Py_ssize_t j0 = 0; j0 < n; j0 += 16) {                               \
            Py_ssize_t j1 = j0 + 16 < n ? j0 + 16 : n;                            \
            for (Py_ssize_t i = 0; i < rows; i++) {                               \
                const char *in = src + (j0 * m + row0 + i) * size;                \
                char *out = dst + (i * n + j0) * size;                            \
                for (Py_ssize_t j = j0; j < j1; j++, in += m * size, out += size) { \
                    T value;                                                      \
                    memcpy(&value, in, sizeof(T));                                \
                    memcpy(out, &value, sizeof(T));                               \
                }                                                                 \
            }                                                                     \
        }                                                                         \
    }
    static void fastst_transpose_rows(const char *src, char *dst, Py_ssize_t m,
                                      Py_ssize_t n, Py_ssize_t row0, Py_ssize_t rows,
                                      int itemsize) {
        switch (itemsize) {
            case 1: FASTST_TRANSPOSE(uint8_t) break;
            case 2: FASTST_TRANSPOSE(uint16_t) break;
            case 4: FASTST_TRANSPOSE(uint32_t) break;
            case 8: FASTST_TRANSPOSE(uint64_t) break;
        }
    }
    """
    bint fastst_mul_overflow(uint64_t a, uint64_t b, uint64_t* out) noexcept nogil
    void fastst_transpose_rows(const char* src, char* dst, Py_ssize_t m, Py_ssize_t n,
                               Py_ssize_t row0, Py_ssize_t rows, int itemsize) noexcept nogil
    Py_ssize_t fastst_string_end(const uint8_t* p, Py_ssize_t pos, Py_ssize_t n,
                                 int* ascii) noexcept nogil
    int fastst_packed_bytes(uint64_t count, unsigned bits, uint64_t* out) noexcept nogil
    const char* const* fastst_codes
    int fastst_code_of(const char* text, Py_ssize_t length) noexcept nogil


from collections import namedtuple

DEFAULT_MAX_HEADER_SIZE = 100_000_000

TensorInfo = namedtuple("TensorInfo", ["dtype", "shape", "data_offsets", "array_shape"])
TensorInfo.__doc__ = """One tensor's header entry: dtype code, shape (list), data_offsets
(begin, end) relative to the tensor buffer, and array_shape, the shape of its NumPy
array (packed bytes for sub-byte dtypes; None when NumPy cannot hold the shape)."""
cdef int MAX_DIMS = 64   # NumPy's NPY_MAXDIMS
cdef uint64_t INTP_MAX = <uint64_t>0x7FFFFFFFFFFFFFFF


class SafetensorError(ValueError):
    """A safetensors file or buffer breaks a rule of the format."""


class TensorNotFoundError(SafetensorError, KeyError):
    """The file holds no tensor of that name (also a KeyError, as for a mapping)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class SafetensorIndexError(SafetensorError, IndexError):
    """An index reaches outside a tensor (also the IndexError NumPy raises)."""


class SafetensorTypeError(SafetensorError, TypeError):
    """A value of a type or dtype safetensors cannot store (also a TypeError)."""


class SafetensorNotImplementedError(SafetensorError, NotImplementedError):
    """Something the format cannot do, such as saving a tensor that has no data
    (also the NotImplementedError, a RuntimeError, the reference raises)."""


# ---------------------------------------------------------------------------
# Dtypes. Codes are numbered in the order of the reference's Dtype enum, which
# is also the order its writer sorts by (descending), so the code doubles as the
# sort rank.
# ---------------------------------------------------------------------------

DtypeInfo = namedtuple("DtypeInfo", ["code", "bits", "numpy", "torch"])
DtypeInfo.__doc__ = """One safetensors dtype: header code, bits per element, the name of
the NumPy dtype its tensors surface as (packed uint8 for sub-byte codes), and the
name of the torch dtype (None where torch has none)."""

# THE dtype table. Rows are in the order of the reference's Dtype enum, which is
# also the order its writer sorts by (descending), so a row's index is its rank.
DTYPES = (
    DtypeInfo("BOOL", 8, "bool", "bool"),
    DtypeInfo("F4", 4, "uint8", "float4_e2m1fn_x2"),
    DtypeInfo("F6_E2M3", 6, "uint8", None),
    DtypeInfo("F6_E3M2", 6, "uint8", None),
    DtypeInfo("U8", 8, "uint8", "uint8"),
    DtypeInfo("I8", 8, "int8", "int8"),
    DtypeInfo("F8_E5M2", 8, "float8_e5m2", "float8_e5m2"),
    DtypeInfo("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn"),
    DtypeInfo("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu"),
    DtypeInfo("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz"),
    DtypeInfo("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz"),
    DtypeInfo("I16", 16, "int16", "int16"),
    DtypeInfo("U16", 16, "uint16", "uint16"),
    DtypeInfo("F16", 16, "float16", "float16"),
    DtypeInfo("BF16", 16, "bfloat16", "bfloat16"),
    DtypeInfo("I32", 32, "int32", "int32"),
    DtypeInfo("U32", 32, "uint32", "uint32"),
    DtypeInfo("F32", 32, "float32", "float32"),
    DtypeInfo("C64", 64, "complex64", "complex64"),
    DtypeInfo("F64", 64, "float64", "float64"),
    DtypeInfo("I64", 64, "int64", "int64"),
    DtypeInfo("U64", 64, "uint64", "uint64"),
)

DTYPE_CODES = tuple(fastst_codes[code].decode() for code in range(22))
assert DTYPE_CODES == tuple(row.code for row in DTYPES)
cdef int[22] BITS = [8, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64]

_CODE_OF_NAME = {name: i for i, name in enumerate(DTYPE_CODES)}

# Filled on first use, so that `import fastst` does not pay for importing ml_dtypes.
cdef tuple _NUMPY_DTYPES = None      # code -> the NumPy dtype its tensors surface as
cdef dict _CODE_OF_NUMPY_NAME = None  # NumPy dtype name -> code, for writing


cdef inline tuple _numpy_dtypes():
    if _NUMPY_DTYPES is None:
        _load_dtype_tables()
    return _NUMPY_DTYPES


cdef _load_dtype_tables():
    global _NUMPY_DTYPES, _CODE_OF_NUMPY_NAME
    import ml_dtypes
    dtypes = (
        np.dtype(np.bool_), np.dtype(np.uint8), np.dtype(np.uint8), np.dtype(np.uint8),
        np.dtype(np.uint8), np.dtype(np.int8), np.dtype(ml_dtypes.float8_e5m2),
        np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu),
        np.dtype(ml_dtypes.float8_e4m3fnuz), np.dtype(ml_dtypes.float8_e5m2fnuz),
        np.dtype("<i2"), np.dtype("<u2"), np.dtype("<f2"), np.dtype(ml_dtypes.bfloat16),
        np.dtype("<i4"), np.dtype("<u4"), np.dtype("<f4"), np.dtype("<c8"), np.dtype("<f8"),
        np.dtype("<i8"), np.dtype("<u8"),
    )
    # Sub-byte codes have no NumPy dtype of their own (they surface as packed uint8),
    # so they cannot be written from NumPy.
    _CODE_OF_NUMPY_NAME = {
        dt.name: code for code, dt in enumerate(dtypes) if BITS[code] >= 8}
    _NUMPY_DTYPES = dtypes


def numpy_dtype(str code):
    """The NumPy dtype that tensors of header dtype `code` surface as."""
    try:
        return _numpy_dtypes()[_CODE_OF_NAME[code]]
    except KeyError:
        raise SafetensorError(f"unknown dtype {code!r}") from None


def dtype_bits(str code):
    """Bits per element of header dtype `code`."""
    try:
        return BITS[_CODE_OF_NAME[code]]
    except KeyError:
        raise SafetensorError(f"unknown dtype {code!r}") from None


# ---------------------------------------------------------------------------
# Owners: objects that keep memory alive for as long as an array views it.
# ---------------------------------------------------------------------------

cdef class _Mapping:
    """A private (copy-on-write) memory map of a whole file; unmapped when the last
    array viewing it is gone."""
    cdef void* addr
    cdef size_t size

    def __dealloc__(self):
        if self.addr != NULL:
            munmap(self.addr, self.size)
            self.addr = NULL

    def __len__(self):
        return self.size

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        PyBuffer_FillInfo(buffer, self, self.addr, self.size, 0, flags)


cdef class _BufferOwner:
    """Holds a caller's buffer (bytes, bytearray, mmap...) for the arrays that view it."""
    cdef Py_buffer view
    cdef bint held

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
            self.held = False


cdef _Mapping _map_file(int fd, size_t size):
    cdef _Mapping mapping = _Mapping.__new__(_Mapping)
    cdef void* addr
    with nogil:
        addr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0)
    if addr == MAP_FAILED:
        raise OSError(errno, os.strerror(errno))
    mapping.addr = addr
    mapping.size = size
    return mapping


cdef _BufferOwner _hold_buffer(object data):
    cdef _BufferOwner owner = _BufferOwner.__new__(_BufferOwner)
    try:
        PyObject_GetBuffer(data, &owner.view, PyBUF_ANY_CONTIGUOUS | PyBUF_WRITABLE)
    except (BufferError, TypeError):
        try:
            PyObject_GetBuffer(data, &owner.view, PyBUF_ANY_CONTIGUOUS)
        except TypeError:
            raise TypeError(
                f"expected a bytes-like object (bytes, bytearray, memoryview, mmap), "
                f"got {type(data).__name__}") from None
    owner.held = True
    return owner


include "_header.pxi"


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------

cdef int BACKEND_MMAP = 0
cdef int BACKEND_PREAD = 1
cdef int BACKEND_BUFFER = 2


cdef class Reader:
    """An open safetensors file or buffer whose header has been validated."""
    cdef _Header header
    cdef object owner            # _Mapping/_BufferOwner the arrays view; None for pread
    cdef char* data              # start of the tensor buffer in `owner`
    cdef bint writable
    cdef int kind                # BACKEND_*
    cdef int fd                  # pread backend only
    cdef int busy                # pread calls in flight, so close() cannot pull the fd away
    cdef bint is_closed
    cdef uint64_t data_offset    # file offset of the tensor buffer
    cdef readonly str source

    def __cinit__(self):
        self.fd = -1
        self.is_closed = True

    def open_file(self, filename, str backend="mmap", *,
              uint64_t max_header_size=DEFAULT_MAX_HEADER_SIZE):
        if backend not in ("mmap", "pread"):
            raise ValueError(f"backend must be 'mmap' or 'pread', got {backend!r}")
        path = os.fspath(filename)
        self.source = os.fsdecode(path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            self._open_fd(fd, backend == "pread", max_header_size)
        except BaseException:
            if self.fd != fd:
                os.close(fd)
            raise
        if self.fd != fd:
            os.close(fd)
        self.is_closed = False

    cdef _open_fd(self, int fd, bint use_pread, uint64_t max_header_size):
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(21, "Is a directory", self.source)
        if not stat.S_ISREG(info.st_mode):
            _fail(self.source, "not a regular file")
        cdef uint64_t size = info.st_size
        cdef uint64_t n, start
        prefix = _pread_exact(fd, 8 if size >= 8 else size, 0)
        if <uint64_t>len(prefix) < (8 if size >= 8 else size):
            _fail(self.source, "file was truncated while its header was read")
        n, start = _split_prefix(self.source, <const uint8_t*>PyBytes_AS_STRING(prefix),
                                 size, max_header_size)
        header = _pread_exact(fd, n, 8)
        if <uint64_t>len(header) != n:
            _fail(self.source, "file was truncated while its header was read")
        self.header = parse_header(header, self.source, size - start)
        self.data_offset = start
        os.set_blocking(fd, True)
        if not use_pread:
            mapping = _map_file(fd, size)
            self.owner = mapping
            self.data = <char*>(<_Mapping>mapping).addr + start
            self.writable = True
        self.kind = BACKEND_PREAD if use_pread else BACKEND_MMAP
        # Kept open for copies, which read with pread: a file that shrank then gives a
        # short read and an error, where copying from the map would fault.
        self.fd = fd

    def open_buffer(self, data, *, uint64_t max_header_size=DEFAULT_MAX_HEADER_SIZE,
                     str source="<buffer>"):
        cdef _BufferOwner owner = _hold_buffer(data)
        self.source = source
        cdef const uint8_t* p = <const uint8_t*>owner.view.buf
        cdef uint64_t size = owner.view.len
        cdef uint64_t n, start
        n, start = _split_prefix(source, p, size, max_header_size)
        header = PyBytes_FromStringAndSize(<const char*>p + 8, n)
        self.header = parse_header(header, source, size - start)
        self.data_offset = start
        self.kind = BACKEND_BUFFER
        self.owner = owner
        self.data = <char*>owner.view.buf + start
        self.writable = not owner.view.readonly
        self.is_closed = False

    cdef inline _check_open(self):
        if self.is_closed:
            raise SafetensorError(f"{self.source}: file is closed")

    cdef Py_ssize_t _position(self, name) except -1:
        self._check_open()
        position = self.header.index().get(name)
        if position is None:
            raise TensorNotFoundError(f"{self.source}: no tensor named {name!r}")
        return position

    cdef object _array(self, Py_ssize_t i):
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        cdef int ndim = entry.np_ndim
        if ndim < 0:
            _fail(self.source, f"tensor {h.names[i]!r}: shape {h.shape(i)} cannot be a NumPy "
                               f"array (NumPy allows {MAX_DIMS} dims, each below 2**63, whose "
                               f"nonzero product in bytes stays below 2**63)")
        if self.kind == BACKEND_PREAD:
            return self._pread_array(i)
        descr = _numpy_dtypes()[entry.code]
        # A local reference: another thread's close() cannot unmap the memory under us.
        owner = self.owner
        if owner is None:
            self._check_open()
        Py_INCREF(descr)
        try:
            array = PyArray_NewFromDescr(
                &PyArray_Type, <Descr*><PyObject*>descr, ndim, h.numpy_dims(entry), NULL,
                self.data + entry.begin, cnp.NPY_ARRAY_WRITEABLE if self.writable else 0, NULL)
        except ValueError as error:
            _fail(self.source, f"tensor {h.names[i]!r}: shape {h.shape(i)} cannot be a NumPy "
                               f"array ({error})")
        cnp.set_array_base(array, owner)
        return array

    cdef object _pread_array(self, Py_ssize_t i, Py_ssize_t first=0, Py_ssize_t last=-1):
        """Read tensor i into fresh memory: all of it, or rows [first, last) of its
        first axis when `last` is given."""
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        cdef cnp.npy_intp[64] dims
        memcpy(dims, h.numpy_dims(entry), entry.np_ndim * sizeof(cnp.npy_intp))
        cdef uint64_t length = entry.end - entry.begin
        cdef uint64_t skip = 0
        if last >= 0:
            if dims[0] > 0:
                skip = first * (length // dims[0])
                length = (last - first) * (length // dims[0])
            dims[0] = last - first
        cdef cnp.ndarray array = self._empty_with(i, dims)
        cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
        plan.add(<char*>cnp.PyArray_DATA(array), length, self.data_offset + entry.begin + skip)
        self._run(plan, h.names[i])
        return array

    def read_rows(self, name, Py_ssize_t first, Py_ssize_t last):
        """Rows [first, last) of tensor `name`'s first axis, read into fresh memory
        (pread backend), or a view of them (mmap and buffers)."""
        cdef Py_ssize_t i = self._position(name)
        cdef Entry* entry = &self.header.entries[i]
        if entry.np_ndim < 1 or not 0 <= first <= last <= self.header.numpy_dims(entry)[0]:
            raise IndexError(f"rows [{first}, {last}) out of range for tensor {name!r}")
        if self.kind == BACKEND_PREAD:
            return self._pread_array(i, first, last)
        return self._array(i)[first:last]

    @property
    def backend(self):
        """How tensors are served: "mmap", "pread", or "buffer" (from load())."""
        return ("mmap", "pread", "buffer")[self.kind]

    cdef _release_fd_if_closed(self):
        if self.is_closed and self.busy == 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def get_tensor(self, name, *, out=None):
        """The tensor `name`: a zero-copy view of the file's memory map, or, with
        `out`, its bytes read into that C-contiguous array of its dtype and shape."""
        if out is None:
            return self._array(self._position(name))
        self._fill([(self._position(name), out)])
        return out

    def copy_tensors(self):
        """Every tensor, in buffer order, read into fresh memory of its own."""
        self._check_open()
        cdef Py_ssize_t i
        names = self.header.names
        arrays = [self._empty(i) for i in range(len(names))]
        self._fill(list(enumerate(arrays)))
        return dict(zip(names, arrays))

    def read_into(self, dict arrays):
        """Read each named tensor into the array given for it."""
        self._fill([(self._position(name), out) for name, out in arrays.items()])

    cdef object _empty(self, Py_ssize_t i):
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        if entry.np_ndim < 0:
            self._array(i)   # raises the error that says why
        return self._empty_with(i, h.numpy_dims(entry))

    cdef object _empty_with(self, Py_ssize_t i, cnp.npy_intp* dims):
        """A fresh array of tensor i's dtype and ndim, with the given dims."""
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        descr = _numpy_dtypes()[entry.code]
        Py_INCREF(descr)
        try:
            return PyArray_Empty(entry.np_ndim, dims, <Descr*><PyObject*>descr, 0)
        except ValueError as error:
            _fail(self.source, f"tensor {h.names[i]!r}: shape {h.shape(i)} cannot be a NumPy "
                               f"array ({error})")

    cdef _fill(self, list targets):
        """Copy tensors into (position, array) targets, with the GIL released: pread
        from the file in chunks shared by threads, or memcpy from a caller's buffer."""
        self._check_open()
        cdef _Header h = self.header
        cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
        cdef Entry* entry
        cdef cnp.ndarray out
        for i, target in targets:
            entry = &h.entries[<Py_ssize_t>i]
            out = _checked_out(self.source, h.names[i], target, self._empty_like(i))
            plan.add(<char*>cnp.PyArray_DATA(out), entry.end - entry.begin,
                     self.data_offset + entry.begin)
        self._run(plan, h.names[targets[0][0]] if len(targets) == 1 else len(targets))

    def gather_rows(self, name, cnp.ndarray[cnp.npy_intp, ndim=1] rows not None):
        """Rows `rows` (in range, any order, repeats allowed) of tensor `name`'s first
        axis, each read into its place in a fresh array: a gather that reads only
        the rows it returns."""
        cdef Py_ssize_t i = self._position(name), k
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        if entry.np_ndim < 1:
            raise IndexError(f"tensor {name!r} has no axis to gather rows from")
        cdef cnp.npy_intp[64] dims
        memcpy(dims, h.numpy_dims(entry), entry.np_ndim * sizeof(cnp.npy_intp))
        cdef cnp.npy_intp count = dims[0]
        cdef uint64_t row_bytes = (entry.end - entry.begin) // count if count else 0
        for k in range(rows.shape[0]):
            if not 0 <= rows[k] < count:
                raise IndexError(f"row {rows[k]} out of range for tensor {name!r}")
        dims[0] = rows.shape[0]
        cdef cnp.ndarray out = self._empty_with(i, dims)
        cdef char* dest = <char*>cnp.PyArray_DATA(out)
        cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
        for k in range(rows.shape[0]):
            plan.add(dest + k * row_bytes, row_bytes,
                     self.data_offset + entry.begin + rows[k] * row_bytes)
        self._run(plan, name)
        return out

    cdef _run(self, _ReadPlan plan, object what):
        """Carry out a read plan: pread from the file, or memcpy from a buffer.
        `what`, for errors: the tensor's name, or how many tensors the plan reads."""
        if self.kind == BACKEND_BUFFER:
            plan.copy_from(self.data - self.data_offset)
            return
        self.busy += 1
        try:
            self._check_open()
            plan.fd = self.fd
            plan.run_threaded()
        finally:
            self.busy -= 1
            self._release_fd_if_closed()
        plan.raise_if_failed(self.source, what)

    cdef object _empty_like(self, Py_ssize_t i):
        """What an `out` array for tensor i must match: (shape, dtype)."""
        shape = self._numpy_shape(i)
        if shape is None:
            self._array(i)   # raises the error that says why
        return shape, _numpy_dtypes()[self.header.entries[i].code]

    cdef object _numpy_shape(self, Py_ssize_t i):
        """The shape of tensor i's NumPy array (packed for sub-byte dtypes), or None
        when its shape cannot be a NumPy array."""
        cdef Entry* entry = &self.header.entries[i]
        if entry.np_ndim < 0:
            return None
        cdef cnp.npy_intp* dims = self.header.numpy_dims(entry)
        return tuple([dims[k] for k in range(entry.np_ndim)])

    def __getitem__(self, name):
        return self._array(self._position(name))

    def get_tensors(self):
        """Every tensor, in buffer order, as a dict of views."""
        self._check_open()
        cdef Py_ssize_t i
        names = self.header.names
        return {names[i]: self._array(i) for i in range(len(names))}

    def keys(self):
        """Tensor names, sorted."""
        self._check_open()
        return list(self.header.sorted_names())

    def offset_keys(self):
        """Tensor names in buffer order."""
        self._check_open()
        return list(self.header.names)

    def metadata(self):
        """The `__metadata__` str->str map, or None when the file has none."""
        self._check_open()
        metadata = self.header.metadata
        return None if metadata is None else dict(metadata)

    def info(self, name):
        """What the header says of tensor `name`, as a TensorInfo: dtype code, shape,
        data_offsets (relative to the tensor buffer) and array_shape (the NumPy
        shape, packed for sub-byte dtypes; None when NumPy cannot hold the shape)."""
        cdef Py_ssize_t i = self._position(name)
        cdef Entry* entry = &self.header.entries[i]
        return TensorInfo(DTYPE_CODES[entry.code], self.header.shape(i),
                          (entry.begin, entry.end), self._numpy_shape(i))

    @property
    def data_start(self):
        """File (or buffer) offset of the tensor buffer: 8 + the header's length."""
        return self.data_offset

    def __len__(self):
        self._check_open()
        return len(self.header.names)

    def __contains__(self, name):
        self._check_open()
        return name in self.header.index()

    def __iter__(self):
        return iter(self.keys())

    @property
    def closed(self):
        return self.is_closed

    def close(self):
        """Drop the handle's reference to the data. Arrays already returned stay valid."""
        self.is_closed = True
        self.owner = None     # `data` stays set: in-flight reads hold the owner themselves
        self._release_fd_if_closed()

    def __dealloc__(self):
        if self.fd >= 0:
            os.close(self.fd)


cdef cnp.ndarray _checked_out(str source, object name, object out, tuple expected):
    shape, dtype = expected
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out for tensor {name!r} must be a numpy.ndarray, got "
                        f"{type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out for tensor {name!r} must have shape {shape} and dtype {dtype}, "
                         f"got {out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out for tensor {name!r} must be C-contiguous and writable")
    return out


cdef struct ReadJob:
    char* dest
    uint64_t length
    uint64_t offset             # in the file (or buffer)


cdef uint64_t CHUNK = 16 << 20
cdef uint64_t THREADED_BELOW = 64 << 20   # total bytes under which one thread reads


cdef class _ReadPlan:
    """Byte ranges to copy into arrays, cut into chunks that threads share."""
    cdef ReadJob* jobs
    cdef Py_ssize_t n
    cdef Py_ssize_t capacity
    cdef uint64_t total
    cdef int fd
    cdef int error              # first errno a read met
    cdef uint64_t short_by      # bytes a short read (a file that shrank) left unread

    def __dealloc__(self):
        free(self.jobs)

    cdef add(self, char* dest, uint64_t length, uint64_t offset):
        cdef uint64_t part
        cdef ReadJob* last
        self.total += length
        if self.n:     # continues the previous range in memory and in the file: extend it
            last = &self.jobs[self.n - 1]
            if (last.dest + last.length == dest and last.offset + last.length == offset
                    and last.length + length <= CHUNK):
                last.length += length
                return
        while True:
            part = length if length < CHUNK else CHUNK
            if self.n == self.capacity:
                self.capacity = _grow(<void**>&self.jobs, self.capacity, sizeof(ReadJob))
            self.jobs[self.n].dest = dest
            self.jobs[self.n].length = part
            self.jobs[self.n].offset = offset
            self.n += 1
            dest += part
            offset += part
            length -= part
            if length == 0:
                return

    cdef copy_from(self, const char* base):
        cdef Py_ssize_t k
        with nogil:
            for k in range(self.n):
                memcpy(self.jobs[k].dest, base + self.jobs[k].offset, self.jobs[k].length)

    def run(self, Py_ssize_t first, Py_ssize_t step):
        """pread jobs first, first + step, ... (one thread's share)."""
        cdef Py_ssize_t k
        cdef Py_ssize_t got
        cdef int error = 0
        cdef uint64_t short_by = 0
        with nogil:
            k = first
            while k < self.n:
                got = _pread_all(self.fd, self.jobs[k].dest, self.jobs[k].length,
                                 self.jobs[k].offset)
                if got < 0:
                    error = -got
                elif <uint64_t>got < self.jobs[k].length:
                    short_by += self.jobs[k].length - got
                k += step
        # back under the GIL: threads report one at a time
        self.error = self.error or error
        self.short_by += short_by

    cdef run_threaded(self):
        cdef Py_ssize_t threads = 1
        if self.total >= THREADED_BELOW:
            threads = min(len(os.sched_getaffinity(0)), 8, self.n)
        if threads <= 1:
            self.run(0, 1)
            return
        import threading
        helpers = [threading.Thread(target=self.run, args=(k, threads))
                   for k in range(1, threads)]
        for helper in helpers:
            helper.start()
        try:
            self.run(0, threads)
        finally:
            for helper in helpers:
                helper.join()

    cdef raise_if_failed(self, str source, object what):
        if self.error:
            raise OSError(self.error, os.strerror(self.error), source)
        if self.short_by:
            tensors = f"tensor {what!r}" if isinstance(what, str) else f"{what} tensors"
            _fail(source, f"{tensors}: file was truncated under the reader ({self.short_by} "
                          f"bytes missing)")


cdef bytes _pread_exact(int fd, uint64_t length, uint64_t offset):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, length)
    cdef char* buffer = PyBytes_AS_STRING(out)
    cdef Py_ssize_t got
    with nogil:
        got = _pread_all(fd, buffer, length, offset)
    if got < 0:
        raise OSError(-got, os.strerror(-got))
    return out if <uint64_t>got == length else out[:got]


cdef Py_ssize_t _pread_all(int fd, char* out, uint64_t length, uint64_t offset) noexcept nogil:
    """Read until `length` bytes or end of file; -errno on failure."""
    cdef uint64_t done = 0
    cdef Py_ssize_t got
    cdef size_t chunk
    while done < length:
        chunk = length - done if length - done < (<size_t>1 << 30) else (<size_t>1 << 30)
        got = pread(fd, out + done, chunk, <off_t>(offset + done))
        if got < 0:
            if errno == EINTR:
                continue
            return -errno
        if got == 0:
            break
        done += got
    return done


# ---------------------------------------------------------------------------
# Writing: every writer hands over explicit specs; one plan, one output loop
# ---------------------------------------------------------------------------

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
            raise SafetensorTypeError(f"tensor {name!r}: object arrays cannot be saved")
        raise SafetensorTypeError(
            f"tensor {name!r}: dtype {dtype} has no safetensors code (supported: "
            f"{', '.join(sorted(_CODE_OF_NUMPY_NAME))})")
    return code


def spec_of_array(name, array):
    """The TensorSpec that writes NumPy `array` as tensor `name`."""
    if type(name) is not str:
        raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    if isinstance(array, np.generic):
        array = np.asarray(array)
    elif not isinstance(array, np.ndarray):
        raise TypeError(f"tensor {name!r}: expected a numpy.ndarray, got "
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
        raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    if name == "__metadata__":
        raise ValueError("'__metadata__' is reserved for the header's metadata and cannot "
                         "name a tensor")
    if name in seen:
        raise ValueError(f"tensor {name!r} is given twice")
    seen.add(name)
    rank = _CODE_OF_NAME.get(code) if type(code) is str else None
    if rank is None:
        raise SafetensorTypeError(f"tensor {name!r}: unknown dtype code {code!r} "
                                  f"(known: {', '.join(DTYPE_CODES)})")
    if not isinstance(source, np.ndarray):
        raise TypeError(f"tensor {name!r}: the source must be a numpy.ndarray, got "
                        f"{type(source).__name__}")
    cdef uint64_t count = 1, dim, nbytes
    for value in shape:
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                or not 0 <= value <= UINT64_MAX):
            raise ValueError(f"tensor {name!r}: shape must hold unsigned integers, got "
                             f"{shape!r}"[:300])
        dim = value
        if fastst_mul_overflow(count, dim, &count):
            raise ValueError(f"tensor {name!r}: element count of shape {shape} overflows 64 bits")
    cdef int status = fastst_packed_bytes(count, BITS[<int>rank], &nbytes)
    if status < 0:
        raise ValueError(f"tensor {name!r}: {count} elements of {code} ({BITS[<int>rank]} "
                         f"bits each) do not fill whole bytes")
    if status > 0 or nbytes != <uint64_t>source.nbytes:
        raise ValueError(f"tensor {name!r}: shape {list(shape)} x {code} needs {nbytes} bytes "
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
            raise TypeError(f"metadata must map str to str, got {key!r}: {value!r}"[:300])
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
