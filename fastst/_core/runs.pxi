# Runs of bytes inside one tensor, read one after another into one array: the part
# of a tensor that a shard or a rank owns, and nothing else (included by __init__.pyx).


def read_runs(Reader reader, name, offsets, length, out):
    """Read runs of bytes of one tensor, and nothing else, one after another into `out`."""
    cdef Py_ssize_t i = reader._position(name)
    cdef Entry* entry = &reader.header.entries[i]
    cdef uint64_t size = entry.end - entry.begin
    if isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer)):
        raise SafetensorTypeError(f"{reader.source}: tensor {_shown(name)}: the length of "
                                  f"a run must be an integer, got {type(length).__name__}")
    if not 0 <= length <= size:
        raise SafetensorIndexError(f"{reader.source}: tensor {_shown(name)}: runs of "
                                   f"{length} bytes do not fit in its {size} bytes")
    cdef cnp.ndarray starts = _run_starts(reader.source, name, offsets)
    cdef Py_ssize_t n = starts.shape[0]
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out for tensor {_shown(name)} must be a C-contiguous, writable "
                         f"numpy.ndarray")
    if out.nbytes != n * <uint64_t>length:
        raise ValueError(f"out for tensor {_shown(name)} must hold {n} runs of {length} bytes "
                         f"({n * <uint64_t>length} bytes), not {out.nbytes}")
    if n and (starts.min() < 0 or <uint64_t>starts.max() > size - <uint64_t>length):
        bad = starts[(starts < 0) | (starts > <int64_t>(size - <uint64_t>length))][0]
        raise SafetensorIndexError(f"{reader.source}: tensor {_shown(name)}: bytes [{bad}, "
                                   f"{bad + length}) are not within its {size} bytes")
    if n == 0 or length == 0:
        return out
    cdef const int64_t[::1] at = starts
    cdef char* dest = <char*>cnp.PyArray_DATA(out)
    cdef uint64_t run = length
    cdef uint64_t base = reader.data_offset + entry.begin
    cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
    cdef Py_ssize_t k
    for k in range(n):
        plan.add(dest + k * run, run, base + <uint64_t>at[k])
    reader._run(plan, name)
    return out


cdef cnp.ndarray _run_starts(str source, object name, object offsets):
    """`offsets` as a fresh 1-d int64 array (integers only)."""
    array = np.asarray(offsets)
    if array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
        raise SafetensorTypeError(f"{source}: tensor {_shown(name)}: the offsets of runs "
                                  f"must be a 1-d sequence of integers, got {array.dtype} "
                                  f"of shape {array.shape}")
    if array.dtype.kind == "u" and array.size and array.max() > INTP_MAX:
        raise SafetensorIndexError(f"{source}: tensor {_shown(name)}: run offset "
                                   f"{int(array.max())} is past any tensor")
    return np.ascontiguousarray(array, dtype=np.int64)
