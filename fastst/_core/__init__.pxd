# What the core's second extension, the loader's ring (_ring.pyx), takes from this one
# at C level; the rest it takes as any module would (Reader's _ring_part, for one).
cdef str _shown(object value)
cdef _count(str key, object amount)
cdef _catch_faults()
cdef void* _fault_guard() noexcept
