# The thread Loader's shuffles, drawn from a NumPy bit generator without the GIL
# (included by _ring.pyx; the kernels are shuffle.h's).

from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport uint16_t

cdef extern from "shuffle.h":
    ctypedef struct bitgen_t:
        pass
    void fastst_shuffle_rows(bitgen_t* bits, int64_t* rows, uint64_t count) noexcept nogil
    void fastst_deal_rows(bitgen_t* bits, int64_t* rows, uint64_t total,
                          uint16_t* labels, uint64_t buckets, int64_t* ends) noexcept nogil

# Rows of a bucket of deal_rows: 256 KiB of them, shuffled in a core's L2 cache.
SHUFFLE_BUCKET_ROWS = 32768


cdef bitgen_t* _bits(bit_generator) except NULL:
    return <bitgen_t*>PyCapsule_GetPointer(bit_generator.capsule, "BitGenerator")


def deal_rows(Py_ssize_t total, bit_generator, Py_ssize_t bucket_rows=SHUFFLE_BUCKET_ROWS):
    """Rows ``0..total-1`` dealt at random to ``ceil(total / bucket_rows)`` buckets (at
    most 65,536), from `bit_generator` (left past its draws), without the GIL: the rows
    bucket after bucket (each bucket's in order), and where each bucket ends among
    them. Each bucket then shuffled in turn by ``shuffle_rows`` from the same generator
    makes a uniformly drawn permutation, each bucket shuffled in the CPU's cache, where
    one shuffle of millions of rows waits on a cache miss a row (the thread Loader's
    full shuffles: a bucket is shuffled as its batches come up)."""
    # Why the deal and the buckets' shuffles draw a uniform permutation: see
    # fastst_deal_rows in shuffle.h.
    if total < 0 or bucket_rows < 1:
        raise ValueError(f"no permutation of {total} rows in buckets of {bucket_rows}")
    # (C division here: rounded up by hand)
    cdef uint64_t buckets = <uint64_t>min(max(1, (total + bucket_rows - 1) // bucket_rows), 65536)
    cdef cnp.ndarray rows = np.empty(total, np.int64)
    cdef cnp.ndarray ends = np.empty(buckets, np.int64)
    cdef cnp.ndarray labels = np.empty(total if buckets > 1 else 0, np.uint16)
    cdef bitgen_t* bits = _bits(bit_generator)
    cdef int64_t* out = <int64_t*>cnp.PyArray_DATA(rows)
    cdef int64_t* bucket_ends = <int64_t*>cnp.PyArray_DATA(ends)
    cdef uint16_t* dealt = <uint16_t*>cnp.PyArray_DATA(labels)
    with bit_generator.lock:
        with nogil:
            fastst_deal_rows(bits, out, <uint64_t>total, dealt, buckets, bucket_ends)
    return rows, ends


def shuffle_rows(rows, bit_generator):
    """Shuffle `rows` (a writable, contiguous int64 array of one axis) in place,
    drawn from `bit_generator`, without the GIL (Fisher-Yates; the thread Loader's
    windows of a block shuffle)."""
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
