# Owners of the memory that arrays view, and read plans: byte ranges copied with pread or
# memcpy, the GIL released, shared by threads (included by _core.pyx).

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
    """Hold any contiguous buffer; arrays viewing it are writable when it is."""
    cdef _BufferOwner owner = _BufferOwner.__new__(_BufferOwner)
    try:
        PyObject_GetBuffer(data, &owner.view, PyBUF_ANY_CONTIGUOUS)
    except TypeError:
        raise SafetensorTypeError(
            f"expected a bytes-like object (bytes, bytearray, memoryview, mmap, NumPy "
            f"array), got {type(data).__name__}") from None
    except (BufferError, ValueError) as error:
        raise SafetensorTypeError(
            f"expected a contiguous bytes-like object, got a {type(data).__name__} that is "
            f"not contiguous ({error})") from None
    owner.held = True
    return owner


# ---------------------------------------------------------------------------
# Read plans
# ---------------------------------------------------------------------------

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
            threads = min(usable_cpus(), 8, self.n)
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
            tensors = f"tensor {_shown(what)}" if isinstance(what, str) else f"{what} tensors"
            _fail(source, f"{tensors}: file was truncated under the reader ({self.short_by} "
                          f"bytes missing)")


def usable_cpus():
    """The CPUs this process may run on (its affinity where the platform tells it),
    which thread pools size themselves by."""
    if hasattr(os, "sched_getaffinity"):    # Linux only
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
# Byte ranges: a read plan carried out by requests to a store
# ---------------------------------------------------------------------------

cdef uint64_t RANGE_BYTES = 8 << 20   # largest request: bigger reads are cut into parts fetched in parallel
cdef uint64_t RANGE_GAP = 4 << 10     # reads this close share a request; the gap is read and dropped
cdef uint64_t BATCH_BYTES = 128 << 20   # bytes one call to fetch brings at most (memory held at once)


cdef struct Piece:
    char* dest
    uint64_t length
    uint64_t at                 # offset in its range's bytes
    Py_ssize_t range


cdef class _RangePlan:
    """A read plan's jobs as requests for byte ranges: in file order, jobs adjacent in
    the file (or less than RANGE_GAP apart) share a range whatever their destinations,
    and ranges are cut at RANGE_BYTES. Each piece copies part of one range to memory."""
    cdef Piece* pieces
    cdef Py_ssize_t n
    cdef Py_ssize_t capacity
    cdef list ranges            # [(offset, length)], in file order

    def __dealloc__(self):
        free(self.pieces)

    cdef add(self, char* dest, uint64_t length, uint64_t at, Py_ssize_t range_index):
        if self.n == self.capacity:
            self.capacity = _grow(<void**>&self.pieces, self.capacity, sizeof(Piece))
        self.pieces[self.n].dest = dest
        self.pieces[self.n].length = length
        self.pieces[self.n].at = at
        self.pieces[self.n].range = range_index
        self.n += 1

    cdef copy_from(self, Py_ssize_t first, Py_ssize_t last, const char** bases,
                   Py_ssize_t range0):
        """Copy pieces [first, last), whose ranges start at range0, from `bases`."""
        cdef Py_ssize_t k
        cdef Piece* piece
        with nogil:
            for k in range(first, last):
                piece = &self.pieces[k]
                memcpy(piece.dest, bases[piece.range - range0] + piece.at, piece.length)


cdef _RangePlan _range_plan(_ReadPlan plan):
    cdef _RangePlan out = _RangePlan.__new__(_RangePlan)
    out.ranges = []
    offsets = np.empty(plan.n, np.uint64)
    cdef uint64_t[::1] offset_of = offsets
    cdef Py_ssize_t k
    for k in range(plan.n):
        offset_of[k] = plan.jobs[k].offset
    cdef cnp.intp_t[::1] order = np.argsort(offsets, kind="stable").astype(np.intp)
    cdef uint64_t start = 0, end = 0, offset, length, take
    cdef bint open_range = False
    cdef char* dest
    for k in range(plan.n):
        dest = plan.jobs[order[k]].dest
        offset = plan.jobs[order[k]].offset
        length = plan.jobs[order[k]].length
        while length:
            if not (open_range and offset <= end + RANGE_GAP and offset < start + RANGE_BYTES):
                if open_range:
                    out.ranges.append((start, end - start))
                start = end = offset
                open_range = True
            take = min(length, start + RANGE_BYTES - offset)
            out.add(dest, take, offset - start, len(out.ranges))
            end = max(end, offset + take)
            dest += take
            offset += take
            length -= take
    if open_range:
        out.ranges.append((start, end - start))
    return out
