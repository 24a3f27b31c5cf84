# The thread Loader's shuffles, drawn from a NumPy bit generator without the GIL
# (included by _core.pyx; the kernels are _shuffle.h's).

from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport uint16_t

cdef extern from "_shuffle.h":
    ctypedef struct bitgen_t:
        pass
    void fastst_shuffle_rows(bitgen_t* bits, int64_t* rows, uint64_t count) noexcept nogil
    void fastst_shuffled_rows(bitgen_t* bits, int64_t* rows, uint64_t total,
                              uint16_t* labels, uint64_t buckets,
                              uint64_t* places) noexcept nogil

# Rows of a bucket of shuffled_rows: 256 KiB of them, shuffled in a core's L2 cache.
SHUFFLE_BUCKET_ROWS = 32768


cdef bitgen_t* _bits(bit_generator) except NULL:
    return <bitgen_t*>PyCapsule_GetPointer(bit_generator.capsule, "BitGenerator")


def shuffled_rows(Py_ssize_t total, bit_generator, Py_ssize_t bucket_rows=SHUFFLE_BUCKET_ROWS):
    """A uniformly drawn permutation of rows 0..total-1 (int64), from `bit_generator`
    (a NumPy BitGenerator, left past the draws), without the GIL: the rows dealt to
    buckets of about `bucket_rows` at random (more where 65,536 buckets would not
    hold them), each bucket then shuffled (see fastst_shuffled_rows in _shuffle.h)."""
    if total < 0 or bucket_rows < 1:
        raise ValueError(f"no permutation of {total} rows in buckets of {bucket_rows}")
    cdef uint64_t buckets = <uint64_t>min(max(1, -(-total // bucket_rows)), 65536)
    cdef cnp.ndarray rows = np.empty(total, np.int64)
    cdef cnp.ndarray labels = np.empty(total if buckets > 1 else 0, np.uint16)
    cdef uint64_t* places = <uint64_t*>PyMem_Calloc(buckets, sizeof(uint64_t))
    if places == NULL:
        raise MemoryError(f"the places of {buckets} buckets")
    cdef bitgen_t* bits = _bits(bit_generator)
    cdef int64_t* out = <int64_t*>cnp.PyArray_DATA(rows)
    cdef uint16_t* dealt = <uint16_t*>cnp.PyArray_DATA(labels)
    try:
        with bit_generator.lock:
            with nogil:
                fastst_shuffled_rows(bits, out, <uint64_t>total, dealt, buckets, places)
    finally:
        PyMem_Free(places)
    return rows


def shuffle_rows(rows, bit_generator):
    """Shuffle `rows` (a writable, contiguous int64 array of one axis) in place, drawn
    from `bit_generator` (a NumPy BitGenerator), without the GIL (Fisher-Yates)."""
    cdef cnp.ndarray array = rows
    if (cnp.PyArray_NDIM(array) != 1 or cnp.PyArray_TYPE(array) != cnp.NPY_INT64
            or not cnp.PyArray_IS_C_CONTIGUOUS(array) or not cnp.PyArray_ISWRITEABLE(array)):
        raise ValueError("shuffle_rows takes a writable, contiguous int64 array of one axis")
    cdef bitgen_t* bits = _bits(bit_generator)
    cdef int64_t* data = <int64_t*>cnp.PyArray_DATA(array)
    cdef uint64_t count = <uint64_t>cnp.PyArray_DIM(array, 0)
    with bit_generator.lock:
        with nogil:
            fastst_shuffle_rows(bits, data, count)
