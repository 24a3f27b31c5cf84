# cython: language_level=3
"""The thread Loader's engine, the compiled core's second extension: ``BatchRing``, threads
that gather batches of rows from the files' maps into a ring of buffers without the GIL,
and the shuffles drawn from a NumPy bit generator without the GIL. Nothing reads or
writes a file through it: ``import fastst._core`` leaves it unloaded."""
import os

import numpy as np

cimport numpy as cnp
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from posix.unistd cimport close

from fastst._core cimport COUNT_FILES_CHECKED, _catch_faults, _count, _fault_guard, _shown

from fastst._core import Reader, SafetensorError

cnp.import_array()

cdef extern from "kernels.h":
    uint64_t fastst_load_u64(const uint64_t* p) noexcept nogil
    void fastst_store_u64(uint64_t* p, uint64_t value) noexcept nogil

include "batches.pxi"    # BatchRing: the thread Loader's gathers, without the GIL
include "shuffle.pxi"    # the thread Loader's shuffles, without the GIL

fastst_batches_use_guard(_fault_guard())   # copies guarded by the core's one handler
