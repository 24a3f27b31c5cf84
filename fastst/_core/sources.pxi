# Owners of the memory that arrays view, and read plans: byte ranges copied with pread or
# memcpy, the GIL released, shared by threads (included by __init__.pyx).

cdef class _Mapping:
    """A private (copy-on-write) memory map of a whole file; unmapped when the last
    array viewing it is gone (and the thread reading it ahead, if one still runs,
    has stopped)."""
    cdef void* addr
    cdef size_t size
    cdef fastst_map_reader ahead    # see read_ahead()

    def __dealloc__(self):
        fastst_map_reader_stop(&self.ahead)
        if self.addr != NULL:
            munmap(self.addr, self.size)
            self.addr = NULL

    cdef bint read_ahead(self, char* begin, char* end):
        """Start a thread mapping the pages of [begin, end) that the page cache does
        not hold, in order, reading them (see fastst_map_reader in kernels.h), once a
        map, and while the map readers running hold no more than half the machine's
        memory: True when it started."""
        if fastst_map_reader_start(&self.ahead, begin, end, read_ahead_limit()) != 0:
            return False
        _count(COUNT_MAPS_READ_AHEAD, 1)
        return True

    cdef bint read_ahead_on_faults(self, bint on):
        """Whether a fault on the map that reads from the file reads ahead of the page
        it touches (the kernel's default) or reads that page alone and starts no read
        ahead (MADV_RANDOM): True where the kernel took the advice."""
        return self.read_ahead_on_faults_in(<char*>self.addr, <char*>self.addr + self.size, on)

    cdef bint read_ahead_on_faults_in(self, char* begin, char* end, bint on):
        """read_ahead_on_faults for the pages that hold [begin, end) of the map alone."""
        cdef char* first = <char*>(<uintptr_t>begin & ~(<uintptr_t>FASTST_PAGE - 1))
        cdef int error
        with nogil:
            error = madvise(first, end - first, MADV_NORMAL if on else MADV_RANDOM)
        return error == 0

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


cdef uint64_t _READ_AHEAD_LIMIT = 0
fastst_map_readers_init()


cpdef uint64_t read_ahead_limit():
    """Half the machine's memory: the most read into the page cache ahead of use
    and counted on to stay there (the map readers' bytes at once, and a data set
    whose shuffle reads whole 2 MiB pieces: the thread Loader's); 1 where the
    memory is not known, so that nothing is read ahead."""
    cdef uint64_t limit = fastst_load_u64(&_READ_AHEAD_LIMIT)   # threads ask at once
    if limit != 0:
        return limit
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        limit = 1
    fastst_store_u64(&_READ_AHEAD_LIMIT, limit)
    return limit


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


# How plans read files: set by read_options(). Defaults measured by bench/cold.py on a
# cold local disk (bench/RESULTS.md): two threads with 4 MiB requests in flight read
# at the speed of `cat` on 2 cores, where one thread waited on each request in turn,
# and more threads than cores lost time to one another.
cdef Py_ssize_t READ_THREADS = 0        # 0: the usable CPUs, at most AUTO_THREADS
cdef Py_ssize_t AUTO_THREADS = 4
cdef uint64_t CHUNK = 4 << 20           # bytes one request reads at most
cdef bint READ_DIRECT = False           # O_DIRECT, where the file system takes it
cdef bint READ_HINTS = True             # advice for plans read in file order
cdef uint64_t DIRECT_ALIGN = 4096       # O_DIRECT: offsets, lengths and memory aligned to it
cdef uint64_t MAX_READ_THREADS = 64
# A plan this small is read from the page cache first with the GIL held, where there
# is one: two threads reading small tensors would otherwise hand the GIL to each other
# at every read, each waiting for the other's turn (bench/RESULTS.md, threads).
cdef uint64_t CACHED_FIRST_BYTES = 64 << 10

cdef extern from *:
    """
    #ifdef Py_GIL_DISABLED
    #define FASTST_GIL_BUILD 0
    #else
    #define FASTST_GIL_BUILD 1
    #endif
    """
    bint FASTST_GIL_BUILD

# what plans have read, for read_counters(): requests and bytes by path, in the order
# of the Counter enum (__init__.pxd)
cdef tuple COUNTER_NAMES = (
    "requests", "bytes", "direct_requests", "direct_bytes", "bounced_bytes",
    "direct_refused", "hinted_plans", "threads_started", "primed_plans", "primed_bytes",
    "maps_read_ahead", "rows_cached", "files_checked", "cached_requests")
cdef uint64_t _COUNTS[<int>COUNTERS]
# Held by read_options(): threads setting options at once would mix them.
cdef object _SETTING_OPTIONS = _thread.allocate_lock()


cdef void _count(Counter counter, uint64_t amount) noexcept nogil:
    if amount:
        fastst_add_u64(&_COUNTS[<int>counter], amount)


def read_options(*, threads=None, request_bytes=None, direct=None, hints=None,
                 huge_pages=None):
    """Set how local files are read into fresh memory, and return the options
    that were in force before the call (with no argument, only return them)."""
    global READ_THREADS, CHUNK, READ_DIRECT, READ_HINTS, HUGE_PAGES
    with _SETTING_OPTIONS:     # a call's options all at once, and `before` whole
        before = _record("ReadOptions")(READ_THREADS, CHUNK, READ_DIRECT, READ_HINTS,
                                          HUGE_PAGES)
        if threads is not None:
            if type(threads) is not int or not 0 <= threads <= MAX_READ_THREADS:
                raise SafetensorError(f"threads must be an integer from 0 to {MAX_READ_THREADS}, "
                                      f"got {_shown(threads)}")
        if request_bytes is not None:
            if (type(request_bytes) is not int or not (64 << 10) <= request_bytes <= (1 << 30)
                    or request_bytes % DIRECT_ALIGN):
                raise SafetensorError(f"request_bytes must be a multiple of {DIRECT_ALIGN} from "
                                      f"64 KiB to 1 GiB, got {_shown(request_bytes)}")
        for name, flag in (("direct", direct), ("hints", hints), ("huge_pages", huge_pages)):
            if flag is not None and type(flag) is not bool:
                raise SafetensorError(f"{name} must be True or False, got {_shown(flag)}")
        if threads is not None:
            fastst_store_ssize(&READ_THREADS, threads)
        if request_bytes is not None:
            fastst_store_u64(&CHUNK, request_bytes)
        if direct is not None:
            fastst_store_int(<int*>&READ_DIRECT, direct)
        if hints is not None:
            fastst_store_int(<int*>&READ_HINTS, hints)
        if huge_pages is not None:
            fastst_store_int(<int*>&HUGE_PAGES, huge_pages)
        return before


def read_counters():
    """What read plans on local files have done since the process started, a count
    by name: for tests and benchmarks, which compare two snapshots."""
    return {name: fastst_load_u64(&_COUNTS[k]) for k, name in enumerate(COUNTER_NAMES)}


def hint_sequential(int fd, uint64_t offset, uint64_t length):
    """Tell the kernel that bytes ``[offset, offset + length)`` of the file open as
    `fd` will be read once, in order (``posix_fadvise(POSIX_FADV_SEQUENTIAL)``),
    unless `read_options` turned hints off: True when it was told (never where the
    system takes no such advice)."""
    if not _hints_option() or fastst_advise_file(fd, offset, length, FASTST_ADVISE_SEQUENTIAL) != 0:
        return False
    _count(COUNT_HINTED_PLANS, 1)
    return True


cdef Py_ssize_t PREFETCH_JOBS = 8         # copies whose source is asked for ahead of its copy
cdef bint HUGE_PAGES = True                # big fresh arrays in huge pages (see kernels.h)

# read_options() writes the options (under _SETTING_OPTIONS) while reads in other
# threads read them: through these, atomically (see fastst_load_int)
cdef inline Py_ssize_t _read_threads_option() noexcept nogil:
    return fastst_load_ssize(&READ_THREADS)
cdef inline uint64_t _chunk_option() noexcept nogil:
    return fastst_load_u64(&CHUNK)
cdef inline bint _direct_option() noexcept nogil:
    return fastst_load_int(<int*>&READ_DIRECT)
cdef inline bint _hints_option() noexcept nogil:
    return fastst_load_int(<int*>&READ_HINTS)
cdef inline bint _huge_pages_option() noexcept nogil:
    return fastst_load_int(<int*>&HUGE_PAGES)
cdef uint64_t HUGE_ARRAY_BYTES = 4 << 20   # fresh arrays this big or bigger get huge pages
cdef object _HUGE_HANDLER = fastst_huge_handler_capsule()
cdef str HUGE_ADVICE = None               # see use_huge_page_settings
cdef str BUDDYINFO = "/proc/buddyinfo"
cdef double FREE_READ_EVERY = 0.1          # seconds a reading of free 2 MiB blocks is used
cdef double _free_read_at = -1.0
cdef uint64_t _free_huge = 0               # bytes of free 2 MiB blocks, less those advised since


def use_huge_page_settings(folder="/sys/kernel/mm/transparent_hugepage",
                           buddyinfo="/proc/buddyinfo"):
    """Decide when fresh arrays are advised ``MADV_HUGEPAGE`` from the kernel's
    transparent huge page settings in `folder` (``enabled``, ``defrag``), and
    where free memory is counted (`buddyinfo`): return the decision, ``"never"``,
    ``"always"`` or ``"while free"``. Made before the first big array; with other
    arguments, for tests."""
    global HUGE_ADVICE, BUDDYINFO, _free_read_at
    HUGE_ADVICE, BUDDYINFO, _free_read_at = huge_page_advice(folder), buddyinfo, -1.0
    return HUGE_ADVICE


cdef str huge_page_advice(str folder):
    try:
        enabled = _setting(os.path.join(folder, "enabled"))
        defrag = _setting(os.path.join(folder, "defrag"))
    except OSError:
        return "never"
    if enabled != "madvise":
        return "never"
    return "always" if defrag in ("defer", "never") else "while free"


cdef str _setting(str path):
    """The choice in force in a sysfs file that lists them ("always [madvise] never")."""
    with open(path) as file:
        for word in file.read().split():
            if word.startswith("[") and word.endswith("]"):
                return word.strip("[]")
    return ""


def free_huge_page_bytes(path="/proc/buddyinfo"):
    """Bytes of free memory in blocks of 2 MiB or more, in the zones that serve a
    process's memory (all but DMA), from the kernel's free lists in `path`; 0 where
    it cannot be read."""
    cdef uint64_t total = 0
    order = (FASTST_HUGE_PAGE // os.sysconf("SC_PAGE_SIZE")).bit_length() - 1
    try:
        with open(path) as file:
            lines = file.read().splitlines()
    except OSError:
        return 0
    for line in lines:
        words = line.split()
        if len(words) < 4 or words[3] == "DMA":     # "Node 0, zone Normal n0 n1 ..."
            continue
        for k, count in enumerate(words[4 + order:]):
            total += int(count) * (FASTST_HUGE_PAGE << k)
    return total


cdef object _ADVISING_HUGE = _thread.allocate_lock()


cdef bint _advise_huge(uint64_t nbytes):
    """Whether a fresh array of `nbytes` is advised MADV_HUGEPAGE (see
    use_huge_page_settings). Under a lock: threads making big arrays at once share
    the settings read once and the count of free blocks."""
    with _ADVISING_HUGE:
        return _advise_huge_locked(nbytes)


cdef bint _advise_huge_locked(uint64_t nbytes):
    global _free_read_at, _free_huge
    if HUGE_ADVICE is None:
        use_huge_page_settings()
    if HUGE_ADVICE != "while free":
        return HUGE_ADVICE == "always"
    now = monotonic()
    if now - _free_read_at > FREE_READ_EVERY:
        _free_huge, _free_read_at = free_huge_page_bytes(BUDDYINFO), now
    if _free_huge < 2 * nbytes:
        return False
    _free_huge -= nbytes
    return True


cdef object _fresh_array(int ndim, cnp.npy_intp* dims, object descr):
    """PyArray_Empty (which steals the reference to `descr`), with the memory of a
    big array from the huge-page handler where read_options() allows it."""
    global fastst_advise_huge
    cdef uint64_t nbytes = (<cnp.dtype>descr).itemsize
    cdef int k
    for k in range(ndim):
        nbytes *= <uint64_t>dims[k]
    if not _huge_pages_option() or nbytes < HUGE_ARRAY_BYTES:
        return PyArray_Empty(ndim, dims, <Descr*><PyObject*>descr, 0)
    fastst_advise_huge = _advise_huge(nbytes)
    before = PyDataMem_SetHandler(_HUGE_HANDLER)
    try:
        return PyArray_Empty(ndim, dims, <Descr*><PyObject*>descr, 0)
    finally:
        PyDataMem_SetHandler(before)


cdef class _ReadPlan:
    """Byte ranges to copy into arrays, cut into requests that threads share."""
    cdef ReadJob* jobs
    cdef Py_ssize_t n
    cdef Py_ssize_t capacity
    cdef uint64_t total
    cdef int fd
    cdef int direct_fd          # the file opened with O_DIRECT, or -1
    cdef int error              # first errno a read met
    cdef uint64_t short_by      # bytes a short read (a file that shrank) left unread
    cdef uint64_t chunk         # the largest request
    cdef Py_ssize_t threads     # shared by, where read_options sets none (0: read_threads())
    cdef uint64_t requests, direct_requests, direct_bytes, bounced_bytes
    cdef Py_ssize_t* groups     # group g: jobs [groups[g], groups[g + 1]) (see group())
    cdef Py_ssize_t ngroups
    cdef bint hinted            # told the kernel already (see hint() and prime())
    cdef fastst_primer primer   # reading ahead of the plan while it is made (see prime())

    def __cinit__(self):
        self.direct_fd = -1
        self.chunk = _chunk_option()   # fixed for the plan: read_options() may change it

    def __dealloc__(self):
        fastst_primer_stop(&self.primer)     # joined already, unless an error came first
        free(self.jobs)
        free(self.groups)

    cdef add(self, char* dest, uint64_t length, uint64_t offset):
        cdef uint64_t part
        cdef ReadJob* last
        self.total += length
        if self.n:     # continues the previous range in memory and in the file: extend it
            last = &self.jobs[self.n - 1]
            if (last.dest + last.length == dest and last.offset + last.length == offset
                    and last.length + length <= self.chunk):
                last.length += length
                return
        while True:
            part = length if length < self.chunk else self.chunk
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

    cdef copy_from(self, const char* base, str source, object what):
        """Copy the jobs from memory, their offsets counted from `base`, without the
        GIL. The copy is guarded (see faults.h): memory that faults (a file mapped
        there, cut short) ends it with the SafetensorError that says so, for `what`
        of `source` (as raise_if_failed)."""
        cdef _Copies copies
        cdef const char* faulted
        cdef int ended
        _catch_faults()
        copies.jobs, copies.n, copies.base = self.jobs, self.n, base
        with nogil:
            ended = fastst_fault_guarded(_copy_jobs, &copies, &faulted)
        if ended:
            _fail(source, f"{_tensors(what)}: file was truncated under the reader (its "
                          f"mapped bytes could not be read)")

    def run(self, Py_ssize_t first, Py_ssize_t step):
        """Read groups first, first + step, ... (one thread's share): a group of one
        job with pread into its memory (or with O_DIRECT), a group of several small
        jobs adjacent in the file with preadv, straight into each one's memory; a
        small plan read by one thread where there is a GIL, from the page cache
        first, the GIL held."""
        cdef int error = 0
        cdef uint64_t short_by = 0
        cdef _ReadTally tally
        memset(&tally, 0, sizeof(tally))
        cdef char* bounce = NULL
        if self.direct_fd >= 0 and posix_memalign(<void**>&bounce, DIRECT_ALIGN,
                                                  self.chunk + DIRECT_ALIGN) != 0:
            bounce = NULL      # no aligned buffer: this thread reads through the cache
        if (FASTST_GIL_BUILD and step == 1 and self.direct_fd < 0
                and self.total <= CACHED_FIRST_BYTES):
            first = self._read_cached(first, &tally.requests)
        if first < self.ngroups:     # (letting go of the GIL hands it to a waiting thread)
            with nogil:
                self._read_groups(first, step, bounce, &error, &short_by, &tally)
        free(bounce)
        with cython.critical_section(self):     # the plan's threads report one at a time
            self.error = self.error or error
            self.short_by += short_by
            self.requests += tally.requests
            self.direct_requests += tally.direct_requests
            self.direct_bytes += tally.direct_bytes
            self.bounced_bytes += tally.bounced_bytes

    cdef void _read_groups(self, Py_ssize_t first, Py_ssize_t step, char* bounce,
                           int* error, uint64_t* short_by, _ReadTally* tally) noexcept nogil:
        cdef Py_ssize_t g = first, k
        cdef Py_ssize_t got
        while g < self.ngroups:
            if bounce == NULL and self.groups[g + 1] - self.groups[g] > 1:
                got = _read_group(self.fd, self.jobs, self.groups[g], self.groups[g + 1],
                                  short_by, &tally.requests)
                if got < 0:
                    error[0] = -got
                g += step
                continue
            for k in range(self.groups[g], self.groups[g + 1]):
                if bounce != NULL:
                    got = _read_direct(self.direct_fd, self.fd, &self.jobs[k], bounce,
                                       self.chunk + DIRECT_ALIGN, tally)
                else:
                    got = _pread_all(self.fd, self.jobs[k].dest, self.jobs[k].length,
                                     self.jobs[k].offset)
                    tally.requests += 1
                if got < 0:
                    error[0] = -got
                elif <uint64_t>got < self.jobs[k].length:
                    short_by[0] += self.jobs[k].length - got
            g += step

    cdef Py_ssize_t _read_cached(self, Py_ssize_t first, uint64_t* requests) noexcept:
        """Read groups first, first + 1, ... whole from the page cache, the GIL held,
        until one is not all there: the first group left to read."""
        cdef iovec[GROUP_IOVECS] parts
        cdef Py_ssize_t g, count
        cdef uint64_t asked
        for g in range(first, self.ngroups):
            count = self.groups[g + 1] - self.groups[g]
            if count > GROUP_IOVECS:
                return g
            asked = _job_parts(self.jobs, self.groups[g], count, parts)
            if <uint64_t>fastst_pread_cached(self.fd, parts, <int>count,
                                             self.jobs[self.groups[g]].offset) != asked:
                return g     # not all cached, the end of the file, or no such read here
            requests[0] += 1
            _count(COUNT_CACHED_REQUESTS, 1)
        return self.ngroups

    cdef group(self):
        """Cut the jobs into groups that threads take whole: runs of small jobs each
        starting where the one before ends in the file, up to a request's bytes (one
        preadv for all: many small tensors are read as a few large requests, in file
        order, and no byte that was not asked for), and each other job alone."""
        cdef Py_ssize_t k
        cdef uint64_t span_start = 0
        cdef ReadJob* job
        cdef ReadJob* previous
        free(self.groups)
        self.groups = <Py_ssize_t*>malloc((self.n + 1) * sizeof(Py_ssize_t))
        if self.groups == NULL:
            raise MemoryError()
        self.ngroups = 0
        for k in range(self.n):
            job = &self.jobs[k]
            if k and job.length <= self.chunk // 4 and self.jobs[k - 1].length <= self.chunk // 4:
                previous = &self.jobs[k - 1]
                if (previous.offset + previous.length == job.offset
                        and job.offset + job.length - span_start <= self.chunk):
                    continue
            self.groups[self.ngroups] = k
            self.ngroups += 1
            span_start = job.offset
        self.groups[self.ngroups] = self.n

    cdef run_threaded(self):
        cdef Py_ssize_t threads = 1
        self.group()
        if self.total >= 2 * self.chunk:     # a smaller plan is read by the calling thread
            threads = min(_read_threads_option() or self.threads or read_threads(), self.ngroups)
        fastst_primer_signal(&self.primer)   # the readers take over from here
        if threads > 1:
            self._run_on(threads)
        else:
            self.run(0, 1)
        self.stop_priming()
        _count(COUNT_REQUESTS, self.requests)
        _count(COUNT_BYTES, self.total - self.short_by)
        _count(COUNT_DIRECT_REQUESTS, self.direct_requests)
        _count(COUNT_DIRECT_BYTES, self.direct_bytes)
        _count(COUNT_BOUNCED_BYTES, self.bounced_bytes)

    cdef _run_on(self, Py_ssize_t threads):
        import threading
        helpers = [threading.Thread(target=self.run, args=(k, threads), daemon=True)
                   for k in range(1, threads)]
        _count(COUNT_THREADS_STARTED, len(helpers))
        for helper in helpers:
            helper.start()
        try:
            self.run(0, threads)
        finally:
            for helper in helpers:
                helper.join()

    cdef bint in_file_order(self):
        """Whether the jobs read the file forward, each at or after the previous."""
        cdef Py_ssize_t k
        for k in range(1, self.n):
            if self.jobs[k].offset < self.jobs[k - 1].offset + self.jobs[k - 1].length:
                return False
        return True

    cdef bint hint(self):
        """Tell the kernel that a large plan read in file order will read its span
        once, in order, so that it reads further ahead: True when it was told."""
        if self.hinted:
            return True
        if not _hints_option() or self.total < 2 * self.chunk or not self.in_file_order():
            return False
        cdef uint64_t begin = self.jobs[0].offset
        cdef uint64_t end = self.jobs[self.n - 1].offset + self.jobs[self.n - 1].length
        self.hinted = hint_sequential(self.fd, begin, end - begin)
        return self.hinted

    cdef prime(self, uint64_t begin, uint64_t end):
        """Before the plan is made: when it will read bytes [begin, end) of self.fd,
        all of them, in order, and that span is two requests or more, hint it and
        start a primer on it (see kernels.h), so that the disk is busy while the
        caller makes the arrays the plan reads into (for 10,000 small tensors,
        milliseconds of allocation during which nothing was read). The plan's
        readers stop it as they start, find what it read in the page cache and
        carry on where it stopped, on the same descriptor, whose read-ahead state
        they share."""
        if not _hints_option() or _direct_option() or end - begin < 2 * self.chunk:
            return
        self.hinted = hint_sequential(self.fd, begin, end - begin)
        if fastst_primer_start(&self.primer, self.fd, begin, end) == 0:
            _count(COUNT_PRIMED_PLANS, 1)

    cdef stop_priming(self):
        """Stop the primer, if one runs, and wait for it (one request at most)."""
        _count(COUNT_PRIMED_BYTES, fastst_primer_stop(&self.primer))

    cdef raise_if_failed(self, str source, object what):
        if self.error:
            raise OSError(self.error, os.strerror(self.error), source)
        if self.short_by:
            _fail(source, f"{_tensors(what)}: file was truncated under the reader "
                          f"({self.short_by} bytes missing)")


cdef str _tensors(object what):
    """What a read plan reads, for errors: `what` is a tensor's name, or how many."""
    return f"tensor {_shown(what)}" if isinstance(what, str) else f"{what} tensors"


cdef struct _Copies:
    ReadJob* jobs
    Py_ssize_t n
    const char* base             # where the jobs' offsets count from


cdef void _copy_jobs(void* argument) noexcept nogil:
    """Copy each job of a _Copies from its base, the sources asked for ahead."""
    cdef _Copies* copies = <_Copies*>argument
    cdef Py_ssize_t k, ahead
    for k in range(copies.n):
        ahead = k + PREFETCH_JOBS
        if ahead < copies.n:
            fastst_prefetch(copies.base + copies.jobs[ahead].offset, copies.jobs[ahead].length)
        memcpy(copies.jobs[k].dest, copies.base + copies.jobs[k].offset, copies.jobs[k].length)


cdef _catch_faults():
    """Put the SIGBUS handler of guarded copies in place, where it is not (see
    fastst_faults_catch in faults.h)."""
    if fastst_faults_catch() != 0:
        raise OSError(errno, f"{os.strerror(errno)}: setting SIGBUS's handler")


cdef void* _fault_guard() noexcept:
    """fastst_fault_guarded, for the ring's copies: one handler, one guard, whichever
    extension copies."""
    return <void*>fastst_fault_guarded


cdef struct _ReadTally:
    uint64_t requests
    uint64_t direct_requests
    uint64_t direct_bytes
    uint64_t bounced_bytes


cdef enum:
    GROUP_IOVECS = 1024         # IOV_MAX on Linux and macOS: buffers one preadv fills at most


cdef uint64_t _job_parts(ReadJob* jobs, Py_ssize_t first, Py_ssize_t count,
                         iovec* parts) noexcept nogil:
    """Point parts[0:count] at the memory of jobs [first, first + count), for one
    preadv: the bytes they ask for."""
    cdef Py_ssize_t k
    cdef uint64_t asked = 0
    for k in range(count):
        parts[k].iov_base = jobs[first + k].dest
        parts[k].iov_len = jobs[first + k].length
        asked += jobs[first + k].length
    return asked


cdef Py_ssize_t _read_group(int fd, ReadJob* jobs, Py_ssize_t first, Py_ssize_t last,
                            uint64_t* short_by, uint64_t* requests) noexcept nogil:
    """Jobs [first, last), one after another in the file, read straight into their
    memory by preadv, up to GROUP_IOVECS jobs a call; a call that stops early (the
    end of the file) leaves the rest to pread, job by job. The bytes a short read
    left out are added to `short_by`. The bytes read, or -errno."""
    cdef iovec[GROUP_IOVECS] buffers
    cdef Py_ssize_t count, done = 0
    cdef Py_ssize_t got
    cdef uint64_t asked
    while first < last:
        count = min(last - first, <Py_ssize_t>GROUP_IOVECS)
        asked = _job_parts(jobs, first, count, buffers)
        got = preadv(fd, buffers, <int>count, <off_t>jobs[first].offset)
        requests[0] += 1
        if got < 0 and errno == EINTR:
            continue
        if got < 0:
            return -errno
        if <uint64_t>got < asked:
            got = _read_rest(fd, jobs, first, first + count, got, short_by, requests)
            if got < 0:
                return got
        done += got
        first += count
    return done


cdef Py_ssize_t _read_rest(int fd, ReadJob* jobs, Py_ssize_t first, Py_ssize_t last,
                           uint64_t got, uint64_t* short_by, uint64_t* requests) noexcept nogil:
    """After a preadv of jobs [first, last) that brought only `got` bytes: the rest of
    them by pread (the bytes a short read leaves out added to `short_by`). The bytes
    of the jobs read in all, or -errno."""
    cdef Py_ssize_t k, more
    cdef Py_ssize_t done = got
    cdef uint64_t skip
    for k in range(first, last):
        if got >= jobs[k].length:
            got -= jobs[k].length
            continue
        skip, got = got, 0
        more = _pread_all(fd, jobs[k].dest + skip, jobs[k].length - skip,
                          jobs[k].offset + skip)
        requests[0] += 1
        if more < 0:
            return more
        done += more
        short_by[0] += jobs[k].length - skip - more
    return done


cdef Py_ssize_t _read_direct(int direct_fd, int fd, ReadJob* job, char* bounce,
                             uint64_t bounce_bytes, _ReadTally* tally) noexcept nogil:
    """Read one job with O_DIRECT: straight into its memory when its offset, length
    and address are aligned, else the aligned blocks around it through `bounce`
    (`bounce_bytes` long, a multiple of DIRECT_ALIGN). A read the file system
    refuses (EINVAL) goes through the cache instead. The bytes of the job read, or
    -errno."""
    cdef uint64_t mask = DIRECT_ALIGN - 1
    cdef Py_ssize_t got
    if (job.offset & mask) == 0 and (job.length & mask) == 0 and (<size_t>job.dest & mask) == 0:
        got = _pread_all(direct_fd, job.dest, job.length, job.offset)
        if got == -EINVAL:
            tally.requests += 1
            return _pread_all(fd, job.dest, job.length, job.offset)
        tally.requests += 1
        tally.direct_requests += 1
        if got > 0:
            tally.direct_bytes += got
        return got
    cdef uint64_t start = job.offset & ~mask
    cdef uint64_t stop = (job.offset + job.length + mask) & ~mask
    cdef uint64_t at = start, span, skip, take, done = 0
    while at < stop and done < job.length:
        span = stop - at if stop - at < bounce_bytes else bounce_bytes
        got = _pread_all(direct_fd, bounce, span, at)
        if got == -EINVAL:
            tally.requests += 1
            got = _pread_all(fd, job.dest + done, job.length - done, job.offset + done)
            return got if got < 0 else <Py_ssize_t>(done + got)
        tally.requests += 1
        if got < 0:
            return got
        tally.direct_requests += 1
        tally.direct_bytes += got
        skip = job.offset + done - at       # bytes of the first block before the job's
        if <uint64_t>got <= skip:
            break                           # the file ends before the job's next byte
        take = <uint64_t>got - skip
        if take > job.length - done:
            take = job.length - done
        memcpy(job.dest + done, bounce + skip, take)
        tally.bounced_bytes += take
        done += take
        if <uint64_t>got < span:
            break                           # end of file
        at += span
    return done


def read_threads():
    """The threads a read plan of two requests or more is shared by now: the
    ``threads`` of `read_options`, or by default one per usable CPU, at most 4."""
    return _read_threads_option() or min(usable_cpus(), AUTO_THREADS)


def usable_cpus():
    """The CPUs this process may run on (its affinity where the platform tells it),
    which thread pools size themselves by."""
    if hasattr(os, "sched_getaffinity"):    # Linux only
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def file_system_type(path):
    """The magic number of the file system that holds `path` (statfs's f_type, as
    linux/magic.h names them: 0x6969 for NFS...); 0 where the platform tells none.
    OSError where the path cannot be looked up."""
    cdef bytes encoded = os.fsencode(path)
    if b"\0" in encoded:
        raise ValueError("embedded null byte")
    cdef const char* c_path = encoded
    cdef int64_t found
    cdef int error = 0
    with nogil:     # a network file system may take a round trip to answer
        found = fastst_file_system_type(c_path)
        if found < 0:
            error = errno
    if found < 0:
        raise OSError(error, os.strerror(error), os.fsdecode(path))
    return found


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


# Runs this long are fetched into their arrays (a fetch_into joins neighbours into shared
# requests), shorter ones staged: a run read into place costs the fetch's Python a call or
# two, which a staged copy of a few KiB costs less than.
cdef uint64_t DIRECT_BYTES = 64 << 10


cdef list _direct_runs(_ReadPlan plan, _ReadPlan staged):
    """The plan's runs of jobs that follow one another both in the file and in memory,
    in file order: those of DIRECT_BYTES or more as [(offset, length, address)], the
    others' jobs added to `staged`."""
    direct = []
    cdef Py_ssize_t k, first = 0
    cdef cnp.intp_t[::1] order = _file_order(plan)
    cdef ReadJob* job
    cdef ReadJob* previous
    for k in range(plan.n + 1):
        if k < plan.n and k > first:
            job, previous = &plan.jobs[order[k]], &plan.jobs[order[k - 1]]
            if (job.offset == previous.offset + previous.length
                    and job.dest == previous.dest + previous.length):
                continue
        if k > first:
            _take_run(plan, order, first, k, direct, staged)
        first = k
    return direct


cdef _take_run(_ReadPlan plan, cnp.intp_t[::1] order, Py_ssize_t first, Py_ssize_t last,
               list direct, _ReadPlan staged):
    cdef ReadJob* start = &plan.jobs[order[first]]
    cdef ReadJob* end = &plan.jobs[order[last - 1]]
    cdef uint64_t length = end.offset + end.length - start.offset
    cdef Py_ssize_t k
    if length >= DIRECT_BYTES:
        direct.append((start.offset, length, <uintptr_t>start.dest))
        return
    for k in range(first, last):
        staged.add(plan.jobs[order[k]].dest, plan.jobs[order[k]].length,
                   plan.jobs[order[k]].offset)


cdef cnp.intp_t[::1] _file_order(_ReadPlan plan):
    offsets = np.empty(plan.n, np.uint64)
    cdef uint64_t[::1] offset_of = offsets
    cdef Py_ssize_t k
    for k in range(plan.n):
        offset_of[k] = plan.jobs[k].offset
    return np.argsort(offsets, kind="stable").astype(np.intp)


cdef _RangePlan _range_plan(_ReadPlan plan):
    cdef _RangePlan out = _RangePlan.__new__(_RangePlan)
    out.ranges = []
    cdef Py_ssize_t k
    cdef cnp.intp_t[::1] order = _file_order(plan)
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
