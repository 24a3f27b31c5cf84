# What the core's second extension, the loader's ring (_ring.pyx), takes from this one
# at C level; the rest it takes as any module would (Reader's _ring_part, for one).
from libc.stdint cimport uint64_t

cdef str _shown(object value)
# What read plans and the thread Loader have done (read_counters), each counted by an
# atomic add: a lock that every plan took made threads reading small tensors wait
# on one another.
cdef enum Counter:
    COUNT_REQUESTS
    COUNT_BYTES
    COUNT_DIRECT_REQUESTS
    COUNT_DIRECT_BYTES
    COUNT_BOUNCED_BYTES
    COUNT_DIRECT_REFUSED
    COUNT_HINTED_PLANS
    COUNT_THREADS_STARTED
    COUNT_PRIMED_PLANS
    COUNT_PRIMED_BYTES
    COUNT_MAPS_READ_AHEAD
    COUNT_ROWS_CACHED
    COUNT_FILES_CHECKED
    COUNT_CACHED_REQUESTS
    COUNTERS                    # how many there are
cdef void _count(Counter counter, uint64_t amount) noexcept nogil
cdef _catch_faults()
cdef void* _fault_guard() noexcept
