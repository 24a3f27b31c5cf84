# The thread Loader's gathers over mapped files, without the GIL (included by _ring.pyx).

cdef extern from "batches.h":
    ctypedef struct fastst_batches:
        int tensors, parts, slots
        const int64_t* starts
        char** bases
        const uint64_t* row_bytes
        const int* fds
        const uint64_t* sizes
        const int64_t* order
        int64_t order_rows, batch_rows, first_batch, batch_step, count, ahead
        char** outs
        const int64_t* needs
        int stream
        int taker_fills
        int watch_fd
        int* file_states
        int64_t checks
        int64_t* filled
        int* errors
        int* error_parts
        int64_t* taker_checked
        int* taker_row_parts
    int FASTST_BATCH_OK, FASTST_BATCH_SHORT_FILE, FASTST_BATCH_READER_FAILED
    int FASTST_BATCH_BAD_ROW, FASTST_BATCH_STOPPED, FASTST_BATCH_NOT_YET
    int fastst_batches_init(fastst_batches* ring) noexcept nogil
    void fastst_batches_destroy(fastst_batches* ring) noexcept nogil
    int fastst_batches_work(fastst_batches* ring) noexcept nogil
    int fastst_batches_take(fastst_batches* ring, int64_t place, int* error_part,
                            long wait_ms) noexcept nogil
    void fastst_batches_advance(fastst_batches* ring, int64_t ready,
                                int64_t claimed) noexcept nogil
    void fastst_batches_end(fastst_batches* ring, int stopping) noexcept nogil
    void fastst_batches_index_parts(fastst_batches* ring, int* chunk_parts) noexcept nogil
    int FASTST_BATCH_CHUNKS
    int fastst_batches_can_stream() noexcept nogil
    void fastst_batches_use_guard(void* guard) noexcept nogil
    int fastst_batches_watcher() noexcept nogil
    int fastst_batches_watch(fastst_batches* ring, int watch_fd, int* watches) noexcept nogil

cdef long TAKE_WAIT_MS = 100   # how often a take that waits looks at the signals
# A ring over fewer files checks each by fstat before each batch that takes rows from
# it: a watch made the batches of one file 25%-30% slower in a bench that opens a
# Loader per measurement (the cause not found), where one fstat a batch costs 0.4 us.
# Over 16 files, the watches gained 12%; over 256, 2.1x-2.8x.
WATCH_FROM_FILES = 8

# The consumer fills batches of at most this many bytes itself while it waits, rather
# than sleep until a thread has: a batch handed from thread to thread costs a sleep and
# a wake-up, 10-20 us of CPU here, and the consumer of small batches waited for each.
# Epochs of batches of 128 KiB (256 rows of 512 B) took 0.6x-0.7x the time unshuffled,
# 0.85x-0.95x shuffled, with a fifth to a third of the context switches; of 256 KiB
# 0.65x-0.9x; of 1 MiB about the same, and of 2 MiB up to 1.05x, where the threads and
# the consumer share two CPUs and the batch it waits for comes later.
TAKER_FILLS_BATCH_BYTES = 512 << 10

READER_FAILED = -1      # what BatchRing.take returns for a batch whose reading failed
STOPPED = -2            # and for one the ring stopped before it was filled


cdef bint _streams(uint64_t ring_bytes):
    """Whether a ring of `ring_bytes` is copied into with stores that bypass the cache:
    where it holds more than twice the last level of cache, a batch's lines leave the
    cache before it is taken anyway, and a plain store first reads each line in (8
    batches of 4096 rows of 4 KiB, 128 MiB: 1.3x-1.4x the rows a second here; rings
    of 8 and 16 MiB lost about a tenth, the batch still in the cache when taken, and
    one of 1 MiB neither gained nor lost)."""
    return ring_bytes > 2 * last_level_cache() and fastst_batches_can_stream()


cdef uint64_t _LAST_LEVEL_CACHE = 0


cpdef uint64_t last_level_cache():
    """The bytes of the first CPU's last level of cache, as Linux describes it (glibc's
    sysconf adds up a whole package's); 32 MiB where it cannot be told."""
    cdef uint64_t known = fastst_load_u64(&_LAST_LEVEL_CACHE)   # rings of threads ask at once
    if known != 0:
        return known
    levels = {}
    caches = "/sys/devices/system/cpu/cpu0/cache"
    try:
        folders = [os.path.join(caches, name) for name in os.listdir(caches)
                   if name.startswith("index")]
    except OSError:
        folders = []
    for folder in folders:
        try:
            with open(os.path.join(folder, "level")) as level, \
                    open(os.path.join(folder, "size")) as size:
                text = size.read().strip()
                levels[int(level.read())] = int(text.rstrip("KMG")) << {
                    "K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
        except (OSError, ValueError):
            continue
    known = levels[max(levels)] if levels else 32 << 20
    fastst_store_u64(&_LAST_LEVEL_CACHE, known)
    return known


cdef class BatchRing:
    """Threads that gather batches of rows of several tensors, from the maps of one
    or more files (numbered across them), into a ring of batch buffers, and the
    consumer's side: each thread's loop (``work``) and each batch's wait (``take``)
    run without the GIL, so that no batch costs Python anything but its ``take``
    (the thread Loader's gathers over mapped files)."""
    cdef fastst_batches ring
    cdef bint ready_to_run         # set up, and not closed
    cdef bint initialised          # its lock and conditions made
    cdef list handles, owners, arrays
    cdef int64_t* starts
    cdef char** bases
    cdef uint64_t* row_bytes
    cdef int* fds
    cdef uint64_t* sizes
    cdef char** outs
    cdef int64_t* filled
    cdef int* errors
    cdef int* error_parts
    cdef int64_t* taker_checked
    cdef int* taker_row_parts
    cdef int* watches
    cdef int* file_states
    cdef int* chunk_parts
    cdef list seen_rows          # each tensor: a part with rows has set its row's bytes
    cdef int open_fds
    cdef int watch_fd
    cdef int watched

    def __cinit__(self):
        self.handles, self.owners, self.arrays = [], [], []
        self.watch_fd = -1
        self.seen_rows = []

    def __init__(self, list handles, list starts, tuple names, cnp.ndarray order,
                 int64_t batch_rows, int64_t first, int64_t step, int64_t count,
                 list slots, int64_t ahead, cnp.ndarray needs=None, watch=None):
        cdef int parts = len(handles), tensors = len(names), slot_count = len(slots)
        if self.starts != NULL:
            raise ValueError("a ring is set up once")
        if parts < 1 or tensors < 1 or slot_count < 1 or batch_rows < 1 or step < 1:
            raise ValueError("a ring needs a file, a tensor, a slot, rows and a step")
        if count > 0 and (first < 0 or (first + (count - 1) * step) * batch_rows >= order.shape[0]):
            raise ValueError("a batch of the ring starts past the order's rows")
        if ahead < 0 or (ahead >= slot_count and count > slot_count):
            raise ValueError("the batches ahead must leave the one taken its slot: fewer "
                             "than the slots")
        self._allocate(parts, tensors, slot_count, batch_rows)
        self.seen_rows = [False] * tensors
        order = self._kept(order, np.int64, "order")
        self.ring.order = <const int64_t*>cnp.PyArray_DATA(order)
        self.ring.order_rows = order.shape[0]
        if needs is not None:
            needs = self._kept(needs, np.int64, "needs")
            if needs.shape[0] < count:
                raise ValueError("needs: one per batch")
            self.ring.needs = <const int64_t*>cnp.PyArray_DATA(needs)
        self.ring.tensors, self.ring.parts, self.ring.slots = tensors, parts, slot_count
        self.ring.batch_rows, self.ring.first_batch, self.ring.batch_step = batch_rows, first, step
        self.ring.count, self.ring.ahead = count, ahead
        for p in range(parts + 1):
            self.starts[p] = starts[p]
            if p > 0 and starts[p] < starts[p - 1]:
                raise ValueError("the parts' starts must not decrease")
        if self.starts[0] != 0:
            raise ValueError("the parts' starts begin at row 0")
        fastst_batches_index_parts(&self.ring, self.chunk_parts)
        for p in range(parts):
            self._map_part(p, handles[p], names, starts[p + 1] - starts[p])
        self._watch_files(watch)
        for s in range(slot_count):
            for t in range(tensors):
                self._set_out(s, t, slots[s][names[t]], batch_rows)
        batch_bytes = batch_rows * sum([self.row_bytes[t] for t in range(tensors)])
        self.ring.stream = _streams(slot_count * batch_bytes)
        self.ring.taker_fills = batch_bytes <= TAKER_FILLS_BATCH_BYTES
        _catch_faults()      # a file cut short while its rows are copied: SHORT_FILE
        if fastst_batches_init(&self.ring) != 0:
            raise MemoryError("a ring's lock")
        self.initialised = self.ready_to_run = True

    cdef _allocate(self, int parts, int tensors, int slots, int64_t batch_rows):
        self.starts = <int64_t*>PyMem_Calloc(parts + 1, sizeof(int64_t))
        self.bases = <char**>PyMem_Calloc(parts * tensors, sizeof(char*))
        self.row_bytes = <uint64_t*>PyMem_Calloc(tensors, sizeof(uint64_t))
        self.fds = <int*>PyMem_Calloc(parts, sizeof(int))
        self.sizes = <uint64_t*>PyMem_Calloc(parts, sizeof(uint64_t))
        self.outs = <char**>PyMem_Calloc(slots * tensors, sizeof(char*))
        self.filled = <int64_t*>PyMem_Calloc(slots, sizeof(int64_t))
        self.errors = <int*>PyMem_Calloc(slots, sizeof(int))
        self.error_parts = <int*>PyMem_Calloc(slots, sizeof(int))
        self.taker_checked = <int64_t*>PyMem_Calloc(parts, sizeof(int64_t))
        self.taker_row_parts = <int*>PyMem_Calloc(batch_rows, sizeof(int))
        self.watches = <int*>PyMem_Calloc(parts, sizeof(int))
        self.file_states = <int*>PyMem_Calloc(parts, sizeof(int))
        self.chunk_parts = <int*>PyMem_Calloc(FASTST_BATCH_CHUNKS, sizeof(int))
        if (self.starts == NULL or self.bases == NULL or self.row_bytes == NULL
                or self.fds == NULL or self.sizes == NULL or self.outs == NULL
                or self.filled == NULL or self.errors == NULL or self.error_parts == NULL
                or self.taker_checked == NULL or self.taker_row_parts == NULL
                or self.watches == NULL or self.file_states == NULL
                or self.chunk_parts == NULL):
            raise MemoryError("a ring's tables")
        self.ring.starts, self.ring.bases, self.ring.row_bytes = self.starts, self.bases, self.row_bytes
        self.ring.fds, self.ring.sizes, self.ring.outs = self.fds, self.sizes, self.outs
        self.ring.filled, self.ring.errors, self.ring.error_parts = (
            self.filled, self.errors, self.error_parts)
        self.ring.taker_checked, self.ring.taker_row_parts = (self.taker_checked,
                                                              self.taker_row_parts)
        self.ring.file_states = self.file_states
        self.ring.watch_fd = -1

    cdef cnp.ndarray _kept(self, cnp.ndarray array, dtype, str what):
        if array.dtype != dtype or not cnp.PyArray_IS_C_CONTIGUOUS(array):
            raise ValueError(f"{what}: a C-contiguous array of {np.dtype(dtype)}")
        self.arrays.append(array)
        return array

    cdef _map_part(self, int p, handle, tuple names, int64_t rows):
        """Part p's file: its map's rows of each tensor, and a descriptor on it."""
        if not isinstance(handle, Reader):
            raise ValueError("a ring gathers from mapped files only")
        tensors, fd, size, owner = handle._ring_part(names)
        try:
            for t, (address, count, row_bytes) in enumerate(tensors):
                if count != rows or (count and self.seen_rows[t]
                                     and row_bytes != self.row_bytes[t]):
                    raise ValueError(f"{handle.source}: tensor {_shown(names[t])} does not "
                                     f"have the rows of the part")
                if count:   # a part of no rows (an empty shard) says nothing of a row
                    self.row_bytes[t], self.seen_rows[t] = row_bytes, True
                self.bases[p * len(names) + t] = <char*><uintptr_t>address
        except BaseException:
            os.close(fd)
            raise
        self.fds[p] = fd    # the mapped file, no shorter: checked by _ring_part
        self.open_fds = p + 1
        self.sizes[p] = size
        self.handles.append(handle)
        self.owners.append(owner)     # the map, kept whatever the handle does

    cdef _watch_files(self, watch):
        """Watch the files that can be (see BatchRing in _ring.pyi)."""
        # Over many files, an fstat of every file a batch takes rows from would cost
        # more than the copies: a watched file is checked only when the kernel says
        # it changed.
        if watch or (watch is None and self.ring.parts >= WATCH_FROM_FILES):
            self.watch_fd = fastst_batches_watcher()
        self.watched = fastst_batches_watch(&self.ring, self.watch_fd, self.watches)
        if self.watched == 0 and self.watch_fd >= 0:
            os.close(self.watch_fd)
            self.watch_fd = self.ring.watch_fd = -1

    cdef _set_out(self, int s, int t, buffer, int64_t batch_rows):
        cdef cnp.ndarray array = buffer
        if (not cnp.PyArray_IS_C_CONTIGUOUS(array) or not cnp.PyArray_ISWRITEABLE(array)
                or array.ndim < 1 or array.shape[0] < batch_rows
                or <uint64_t>array.nbytes != <uint64_t>array.shape[0] * self.row_bytes[t]):
            raise ValueError("a slot's buffer: writable, C-contiguous, batch_rows rows of "
                             "the tensor's row")
        self.arrays.append(array)
        self.outs[s * self.ring.tensors + t] = <char*>cnp.PyArray_DATA(array)

    @property
    def streams(self):
        """Whether its copies of rows of whole 128-byte lines bypass the cache (a ring
        larger than twice the last level of cache, where the CPU can)."""
        return bool(self.ring.stream)

    @property
    def files_watched(self):
        """The files whose changes the kernel reports."""
        return self.watched

    @property
    def files_checked(self):
        """The checks of a file's length (fstat calls) made so far."""
        return self.ring.checks

    @staticmethod
    def can_stream():
        """Whether this CPU has the stores that bypass the cache (AVX2)."""
        return bool(fastst_batches_can_stream())

    def work(self):
        """A gathering thread's loop: returns once no batch is left, or at ``stop``."""
        cdef int error
        self._check_ready()
        with nogil:
            error = fastst_batches_work(&self.ring)
        if error != 0:
            raise MemoryError("a gathering thread's table")

    def take(self, int64_t place):
        """Wait for batch `place` (taken in order) and return its slot, filling the
        batches no thread has started meanwhile where they are small
        (TAKER_FILLS_BATCH_BYTES) and their reads are done; READER_FAILED where the
        reading it waited for failed, STOPPED where the ring stopped first. A file cut
        short raises the SafetensorError that says so; a signal's handler
        (Ctrl-C's) runs while it waits, and what it raises comes out of the wait."""
        cdef int error = FASTST_BATCH_NOT_YET, part = -1
        self._check_ready()
        while error == FASTST_BATCH_NOT_YET:
            with nogil:
                error = fastst_batches_take(&self.ring, place, &part, TAKE_WAIT_MS)
            PyErr_CheckSignals()     # Ctrl-C while a batch waits (its reads, say) is raised
        if error == FASTST_BATCH_OK:
            return place % self.ring.slots
        if error == FASTST_BATCH_READER_FAILED:
            return READER_FAILED
        if error == FASTST_BATCH_STOPPED:
            return STOPPED
        if error == FASTST_BATCH_SHORT_FILE and part < 0:
            raise SafetensorError("a file of the dataset was truncated under the reader "
                                  "(reading its map faulted)")
        if error == FASTST_BATCH_SHORT_FILE:
            reader = self.handles[part]
            os.close(reader._reopened())      # raises what changed, where it can tell
            raise SafetensorError(f"{reader.source}: file was truncated under the reader "
                                  f"(it had {self.sizes[part]} bytes when opened)")
        raise AssertionError(f"batch {place} holds a row outside the dataset")

    def advance(self, int64_t ready, int64_t claimed=0):
        """`ready` reads are done, and the needs of the first `claimed` places are set
        (after ``close``: nothing to do)."""
        if not self.initialised:
            raise ValueError("the ring was not set up")
        with nogil:
            fastst_batches_advance(&self.ring, ready, claimed)

    def reading_failed(self):
        """The reading the batches wait for failed: each waiting batch ends READER_FAILED."""
        if not self.initialised:
            raise ValueError("the ring was not set up")
        with nogil:
            fastst_batches_end(&self.ring, 0)

    def stop(self):
        """End the threads' loops (after the batches they are copying) and every wait."""
        if self.initialised:
            with nogil:
                fastst_batches_end(&self.ring, 1)

    def close(self):
        """Once the threads have returned from ``work``: close the files and let go of
        the maps and the buffers (a map goes once nothing else holds it)."""
        self.stop()
        if self.ready_to_run:
            _count(COUNT_FILES_CHECKED, self.ring.checks)
        self.ready_to_run = False
        self._close_fds()
        self.handles, self.owners, self.arrays = [], [], []

    cdef _check_ready(self):
        if not self.ready_to_run:
            raise ValueError("the ring is closed or was not set up")

    cdef _close_fds(self):
        cdef int p
        for p in range(self.open_fds):
            os.close(self.fds[p])
        self.open_fds = 0
        if self.watch_fd >= 0:
            os.close(self.watch_fd)
            self.watch_fd = self.ring.watch_fd = -1

    def __dealloc__(self):
        for p in range(self.open_fds):
            close(self.fds[p])
        if self.watch_fd >= 0:
            close(self.watch_fd)
        if self.initialised:
            fastst_batches_destroy(&self.ring)
        PyMem_Free(self.starts)
        PyMem_Free(self.bases)
        PyMem_Free(self.row_bytes)
        PyMem_Free(self.fds)
        PyMem_Free(self.sizes)
        PyMem_Free(self.outs)
        PyMem_Free(self.filled)
        PyMem_Free(self.errors)
        PyMem_Free(self.error_parts)
        PyMem_Free(self.taker_checked)
        PyMem_Free(self.taker_row_parts)
        PyMem_Free(self.watches)
        PyMem_Free(self.file_states)
        PyMem_Free(self.chunk_parts)
