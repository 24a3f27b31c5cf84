# cython: language_level=3
"""The byte-level core of fastst: header decoding and validation, the memory map,
zero-copy array views, and writes straight from array buffers.

Everything here validates before it trusts: no view exists until the whole header has
been checked against the file's size.
"""
import _thread
import os
import stat
from collections import namedtuple
from collections.abc import Mapping
from time import monotonic

import numpy as np

cimport cython
cimport numpy as cnp
from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS, PyBUF_WRITE, PyBuffer_FillInfo, PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.errno cimport EFAULT, EINTR, EIO, EINVAL, ENOSYS, EOPNOTSUPP, errno
from libc.stdint cimport UINT64_MAX, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset
from posix.mman cimport (MADV_NORMAL, MADV_RANDOM, MAP_FAILED, MAP_PRIVATE, PROT_READ,
                         PROT_WRITE, madvise, mmap, munmap)
from posix.stdlib cimport posix_memalign
from posix.types cimport off_t
from posix.uio cimport iovec, preadv, writev
from posix.unistd cimport close, pread, pwrite, write

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
    object PyDataMem_SetHandler(object handler)   # returns the handler it replaced

cdef extern from "kernels.h":
    int fastst_load_int(const int* p) noexcept nogil
    void fastst_store_int(int* p, int value) noexcept nogil
    int fastst_add_int_ordered(int* p, int amount) noexcept nogil
    int fastst_load_int_ordered(const int* p) noexcept nogil
    void fastst_store_int_ordered(int* p, int value) noexcept nogil
    int fastst_exchange_int(int* p, int value) noexcept nogil
    uint64_t fastst_load_u64(const uint64_t* p) noexcept nogil
    void fastst_store_u64(uint64_t* p, uint64_t value) noexcept nogil
    void fastst_add_u64(uint64_t* p, uint64_t amount) noexcept nogil
    Py_ssize_t fastst_load_ssize(const Py_ssize_t* p) noexcept nogil
    void fastst_store_ssize(Py_ssize_t* p, Py_ssize_t value) noexcept nogil
    PyObject* fastst_load_object(PyObject** p) noexcept nogil
    void fastst_store_object(PyObject** p, PyObject* value) noexcept nogil
    bint fastst_mul_overflow(uint64_t a, uint64_t b, uint64_t* out) noexcept nogil
    int fastst_packed_bytes(uint64_t count, unsigned bits, uint64_t* out) noexcept nogil
    Py_ssize_t fastst_string_end(const uint8_t* p, Py_ssize_t pos, Py_ssize_t n,
                                 int* ascii) noexcept nogil
    void fastst_transpose_rows(const char* src, char* dst, Py_ssize_t m, Py_ssize_t n,
                               Py_ssize_t row0, Py_ssize_t rows, int itemsize) noexcept nogil
    object fastst_huge_handler_capsule()
    int fastst_advise_huge
    void fastst_prefetch(const char* source, uint64_t length) noexcept nogil
    ctypedef struct fastst_primer:
        pass
    int fastst_primer_start(fastst_primer* primer, int fd, uint64_t begin,
                            uint64_t end) noexcept nogil
    void fastst_primer_signal(fastst_primer* primer) noexcept nogil
    uint64_t fastst_primer_stop(fastst_primer* primer) noexcept nogil
    ctypedef struct fastst_map_reader:
        pass
    int fastst_map_reader_start(fastst_map_reader* reader, char* begin, char* end,
                                uint64_t limit) noexcept nogil
    void fastst_map_reader_stop(fastst_map_reader* reader) noexcept nogil
    int fastst_map_readers_init() noexcept nogil
    int fastst_cache_span(int fd, uint64_t begin, uint64_t end, uint64_t size) noexcept nogil
    int fastst_pieces_cached(char* map, uint64_t begin, uint64_t end, uint64_t size) noexcept nogil
    void fastst_drop_partial_first_piece(int fd, uint64_t size) noexcept nogil
    size_t FASTST_HUGE_PAGE
    size_t FASTST_PAGE

cdef extern from "platform.h":
    enum:
        FASTST_ADVISE_NORMAL
        FASTST_ADVISE_SEQUENTIAL
    int fastst_advise_file(int fd, int64_t offset, int64_t length, int advice) noexcept nogil
    int64_t fastst_file_system_type(const char* path) noexcept nogil
    Py_ssize_t fastst_pread_cached(int fd, const iovec* parts, int count,
                                   int64_t offset) noexcept nogil

cdef extern from "faults.h":
    int fastst_faults_catch() noexcept nogil
    int fastst_fault_guarded(void (*copy)(void*) noexcept nogil, void* argument,
                             const char** address) noexcept nogil

DEFAULT_MAX_HEADER_SIZE = 100_000_000
cdef int MAX_DIMS = 64   # NumPy's NPY_MAXDIMS
cdef uint64_t INTP_MAX = <uint64_t>0x7FFFFFFFFFFFFFFF

# The core, in the order data flows through it.
include "errors.pxi"     # the SafetensorError family; _fail; values shown in messages
include "dtypes.pxi"     # THE dtype table and the lists derived from it
include "records.pxi"    # the named tuples and DTYPES, made on first use
include "header.pxi"     # prefix, fast scanner, strict parser, coverage rules
include "sources.pxi"    # mmap and buffer owners; read plans (pread, threads, no GIL)
include "reader.pxi"     # Reader: views, copies, rows, gathers
include "align.pxi"      # aligned files: the header's padding, the tensors' order
include "runs.pxi"       # runs of bytes inside a tensor: the part a shard owns
include "writer.pxi"     # WriteSpec, WritePlan, the one output loop

# The thread Loader's ring and shuffles are a second extension, fastst._core._ring
# (_ring.pyx): loaded with the first of their names used, never by a read or a write.
# This module's folder, where that extension sits, is its path, as a package's is.
__path__ = [os.path.join(os.path.dirname(__file__), "_core")]
RING_NAMES = frozenset({"BatchRing", "READER_FAILED", "STOPPED", "TAKER_FILLS_BATCH_BYTES",
                        "WATCH_FROM_FILES", "last_level_cache", "SHUFFLE_BUCKET_ROWS",
                        "deal_rows", "shuffle_rows"})


def __getattr__(name):
    if name in LAZY_NAMES:
        value = globals()[name] = _record(name)   # found directly from now on
        return value
    if name not in RING_NAMES:
        raise AttributeError(f"module 'fastst._core' has no attribute {name!r}")
    from fastst._core import _ring
    return getattr(_ring, name)
