# Reader: an open file or buffer with a validated header; views, copies, rows and
# gathers (included by __init__.pyx).

cdef int BACKEND_MMAP = 0
cdef int BACKEND_PREAD = 1
cdef int BACKEND_BUFFER = 2
cdef int BACKEND_RANGES = 3
cdef uint64_t HEAD_BYTES = 64 << 10   # first request of a ranged file: prefix and most headers
# How a partial read advised a tensor's range of a file's map (Reader.advice; 0: not
# at all, as the kernel maps a file: with read-around)
cdef unsigned char ADVISED_RANDOM = 1        # a fault reads the page it touches alone
cdef unsigned char ADVISED_READ_AROUND = 2


cdef class Reader:
    """The compiled reader of one safetensors file or buffer, whose header it has
    validated in full: the reading methods of `fastst.NumpyHandle`."""
    cdef _Header header
    cdef object owner            # _Mapping/_BufferOwner the arrays view; None for pread
    cdef char* data              # start of the tensor buffer in `owner`
    cdef bint writable
    cdef int kind                # BACKEND_*
    cdef int fd                  # pread backend only
    cdef int busy                # pread calls in flight, so close() cannot pull the fd away
    cdef Py_ssize_t plan_threads # files: read plans' threads where read_options sets none
    cdef object path             # files: the absolute path (mmap: reopened for copies)
    cdef uint64_t file_dev       # files: st_dev, st_ino, size and mtime of the opened file
    cdef uint64_t file_ino
    cdef uint64_t file_size
    cdef object file_mtime_ns
    cdef bint is_closed
    cdef uint64_t data_offset    # file offset of the tensor buffer
    cdef object fetch            # ranges: fetch([(offset, length), ...]) -> bytes-likes
    cdef object head             # ranges: the file's first bytes, from the first request
    cdef object identity         # ranges: what the opener says names this version of the file
    cdef object first_piece_lock # cache_rows: held while the first 2 MiB piece is prepared
    cdef bint first_piece_ready  # cache_rows: the first piece was prepared (see there)
    cdef list dtypes             # code -> the dtype of its arrays (see uses_ml_dtypes)
    cdef bint leaves_ml_dtypes
    cdef bytearray advice        # mmap: per tensor, how a partial read advised its range
    cdef int advised             # whether `advice` is made: read without the lock
    cdef bint advice_fixed       # read_ahead_on_faults() advised the whole map: kept
    cdef uint64_t read_around    # mmap: the most that a fault reads (see _advise_part)
    cdef readonly str source
    """What error messages call the file: its path, URL, or ``"<buffer>"``."""

    def __cinit__(self):
        self.fd = -1
        self.is_closed = True
        self.dtypes = _NUMPY_DTYPES

    @property
    def uses_ml_dtypes(self):
        """Whether tensors of the dtypes NumPy lacks (bfloat16, float8) come as
        arrays of ml_dtypes' dtypes (True, the default: ml_dtypes is imported when
        a file holding one opens, so that reads never import) or as their bits,
        unsigned integers of their width (False: what a framework with dtypes of
        its own views, with no ml_dtypes loaded)."""
        return not self.leaves_ml_dtypes

    @uses_ml_dtypes.setter
    def uses_ml_dtypes(self, bint value):
        self.leaves_ml_dtypes = not value
        if self.header is not None:
            self._ready_dtypes()

    cdef _ready_dtypes(self):
        """Take the dtypes of the file's arrays, importing ml_dtypes now if they need
        it: reads must not import (nor need a free file descriptor)."""
        if self.leaves_ml_dtypes:
            self.dtypes = _BITS_DTYPES
            return
        self.dtypes = _NUMPY_DTYPES
        if ML_DTYPES_LOADED:
            return
        cdef _Header h = self.header
        cdef Py_ssize_t i
        for i in range(h.n):
            if FROM_ML_DTYPES[h.entries[i].code]:
                _load_ml_dtypes()
                return

    cdef inline object _dtype_of(self, int code):
        dtype = self.dtypes[code]
        # None only for a code the file does not hold (open readied the others)
        return dtype if dtype is not None else _numpy_dtype_of(code)

    def array_dtype(self, str code):
        """The NumPy dtype of this reader's arrays of header dtype `code`:
        ``numpy_dtype(code)``, or its bits where `uses_ml_dtypes` is False."""
        return self._dtype_of(_code_of_name(code))

    def open_file(self, filename, backend="mmap", *,
                  max_header_size=DEFAULT_MAX_HEADER_SIZE, threads=0):
        """Open the local file `filename`: read and validate its header, and map it
        (`backend` ``"mmap"``) or keep it open for reads (``"pread"``). Its read
        plans are shared by `threads` threads (0 to 64) where ``read_options`` sets
        none; 0: ``read_threads()``."""
        cdef uint64_t limit = _checked_limit(max_header_size)
        if not (type(backend) is str and backend in ("mmap", "pread")):
            raise SafetensorError(f"backend must be 'mmap' or 'pread', got {_shown(backend)}")
        if type(threads) is not int or not 0 <= threads <= MAX_READ_THREADS:
            raise SafetensorError(f"threads must be an integer from 0 to {MAX_READ_THREADS}, "
                                  f"got {_shown(threads)}")
        self.plan_threads = threads
        cdef bint use_pread = backend == "pread"
        if use_pread:
            import threading    # large pread copies share the work among threads
        path = os.fspath(filename)
        self.source = os.fsdecode(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError as error:
            raise NoSuchFileError(error.errno, error.strerror, error.filename) from None
        try:
            self._open_fd(fd, use_pread, limit)
        except BaseException:
            if self.fd != fd:
                os.close(fd)
            raise
        if self.fd != fd:
            os.close(fd)    # the map needs no descriptor: a process may hold thousands
        self.path = path if _is_absolute(path) else os.path.abspath(path)
        self.is_closed = False

    cdef _open_fd(self, int fd, bint use_pread, uint64_t max_header_size):
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(21, "Is a directory", self.source)
        if not stat.S_ISREG(info.st_mode):
            _fail(self.source, "not a regular file")
        cdef uint64_t size = info.st_size
        cdef uint64_t n, start
        prefix = _pread_exact(fd, min(size, <uint64_t>8), 0)
        if len(prefix) == 8:
            n = _length_in(<const uint8_t*>PyBytes_AS_STRING(prefix))
            if n > size - 8 or n > max_header_size:     # what is the file instead?
                prefix = _pread_exact(fd, min(size, <uint64_t>SNIFF_BYTES), 0)
        if <uint64_t>len(prefix) < min(size, <uint64_t>8):
            _fail(self.source, "file was truncated while its header was read")
        n, start = _split_prefix(self.source, <const uint8_t*>PyBytes_AS_STRING(prefix),
                                 len(prefix), size, max_header_size)
        header = _pread_exact(fd, n, 8)
        if <uint64_t>len(header) != n:
            _fail(self.source, "file was truncated while its header was read")
        self.header = parse_header(header, self.source, size - start)
        self._ready_dtypes()
        self.data_offset = start
        os.set_blocking(fd, True)
        if not use_pread:
            mapping = _map_file(fd, size)
            self.owner = mapping
            self.data = <char*>(<_Mapping>mapping).addr + start
            self.writable = True
        self.kind = BACKEND_PREAD if use_pread else BACKEND_MMAP
        if use_pread:
            self.fd = fd
        self.file_dev = info.st_dev
        self.file_ino = info.st_ino
        self.file_size = size
        self.file_mtime_ns = info.st_mtime_ns

    def open_buffer(self, data, *, max_header_size=DEFAULT_MAX_HEADER_SIZE,
                    str source="<buffer>"):
        """Open a buffer (bytes, bytearray, memoryview, mmap) holding a whole file,
        without copying it; `source` is what messages call it."""
        cdef uint64_t max_header = _checked_limit(max_header_size)
        cdef _BufferOwner owner = _hold_buffer(data)
        self.source = source
        cdef const uint8_t* p = <const uint8_t*>owner.view.buf
        cdef uint64_t size = owner.view.len
        cdef uint64_t n, start
        n, start = _split_prefix(source, p, size, size, max_header)
        header = PyBytes_FromStringAndSize(<const char*>p + 8, n)
        self.header = parse_header(header, source, size - start)
        self._ready_dtypes()
        self.data_offset = start
        self.kind = BACKEND_BUFFER
        self.owner = owner
        self.data = <char*>owner.view.buf + start
        self.writable = not owner.view.readonly
        self.is_closed = False

    def open_ranges(self, str source, size, fetch, *,
                    max_header_size=DEFAULT_MAX_HEADER_SIZE, identity=None):
        """Open a file of `size` bytes read by byte ranges: ``fetch(ranges)`` takes
        a list of ``(offset, length)`` and returns one bytes-like object per range,
        exactly that long (what ``safe_open`` does for URLs and file objects)."""
        cdef uint64_t limit = _checked_limit(max_header_size)
        if not callable(fetch):
            raise SafetensorTypeError(f"fetch must be callable, got {type(fetch).__name__}")
        if type(size) is not int or not 0 <= size <= UINT64_MAX:
            raise SafetensorError(f"{source}: size must be an integer >= 0, got {_shown(size)}")
        self.source = source
        cdef uint64_t n, start
        head = self._fetch_one(fetch, 0, min(size, HEAD_BYTES), "the header")
        n, start = _split_prefix(source, <const uint8_t*>PyBytes_AS_STRING(head), len(head),
                                 size, limit)
        # Kept for the tensors it holds, when it holds any beyond the header.
        self.head = head if start < <uint64_t>len(head) else b""
        if start > <uint64_t>len(head):
            if getattr(fetch, "ranges_ignored", False):
                head = self._fetch_one(fetch, 0, start, "the header")
            else:
                head += self._fetch_one(fetch, len(head), start - len(head), "the header")
        self.header = parse_header(head[8:start], source, size - start)
        self.data_offset = start
        self.kind = BACKEND_RANGES
        self.fetch = fetch
        self.identity = identity
        self.file_size = size
        self.is_closed = False

    cdef bytes _fetch_one(self, object fetch, uint64_t offset, uint64_t length, str what):
        (got,) = self._checked_fetch(fetch, [(offset, length)], what)
        return bytes(got)

    cdef list _checked_fetch(self, object fetch, list ranges, object what):
        """fetch(ranges), each answer checked to be a buffer of its range's length:
        a store that returns fewer bytes than asked (a short read) or more (too long)
        is an error, never data in the wrong place."""
        got = fetch(ranges)
        if not isinstance(got, (list, tuple)) or len(got) != len(ranges):
            given = (f"{len(got)} of them" if isinstance(got, (list, tuple))
                     else f"a {type(got).__name__}")
            raise SafetensorError(f"{self.source}: fetch must return a list of one bytes-like "
                                  f"per range ({len(ranges)}), got {given}")
        views = []
        for (offset, length), item in zip(ranges, got):
            try:
                view = memoryview(item)
            except TypeError:
                raise SafetensorTypeError(
                    f"{self.source}: fetch returned a {type(item).__name__} for bytes "
                    f"[{offset}, {offset + length}), not a bytes-like object") from None
            if not view.c_contiguous:
                raise SafetensorTypeError(
                    f"{self.source}: fetch returned a {type(item).__name__} for bytes "
                    f"[{offset}, {offset + length}) that is not contiguous")
            view = view.cast("B")
            if view.nbytes != length:
                _fail(self.source, f"{self._holder(offset, what)}: bytes [{offset}, "
                                   f"{offset + length}) came back {view.nbytes} bytes long, "
                                   f"not {length} ("
                                   f"{'a short read' if view.nbytes < length else 'too long'})")
            views.append(view)
        return views

    cdef str _holder(self, uint64_t offset, object what):
        """Who bytes at file offset `offset` belong to, for errors: a tensor, else `what`."""
        cdef Py_ssize_t i
        cdef _Header h = self.header
        if h is not None:
            for i in range(len(h.names)):
                if self.data_offset + h.entries[i].begin <= offset < self.data_offset + h.entries[i].end:
                    return f"tensor {_shown(h.names[i])}"
        if isinstance(what, str):
            return what if what.startswith("the ") else f"tensor {_shown(what)}"
        return f"{what} tensors"

    cdef _run_ranges(self, _ReadPlan plan, object what):
        """Carry out a read plan by requests for byte ranges: coalesced, cut into parts,
        in batches of at most BATCH_BYTES; ranges within the first request's bytes are
        copied from them."""
        with cython.critical_section(self):     # local references: close() cannot pull
            fetch = self.fetch                  # them away
            head = self.head
        self._check_open()
        if (plan.n and plan.total >= self.file_size - self.data_offset
                and self.file_size > <uint64_t>len(head)
                and getattr(fetch, "ranges_ignored", False)):
            # a store that answers only with the whole file: read it once, in one range
            (whole,) = self._checked_fetch(fetch, [(0, self.file_size)], what)
            plan.copy_from(_address(whole), self.source, what)
            return
        if getattr(fetch, "fetch_into", None) is not None and not getattr(
                fetch, "ranges_ignored", False):
            self._run_ranges_into(fetch.fetch_into, head, plan, what)
            return
        cdef _RangePlan ranges = _range_plan(plan)
        cdef Py_ssize_t first = 0, last, piece = 0, end_piece, count = len(ranges.ranges)
        cdef uint64_t batch
        cdef const char** bases = NULL
        try:
            bases = <const char**>malloc(max(count, 1) * sizeof(char*))
            if bases == NULL:
                raise MemoryError()
            while first < count:
                last, batch = first, 0
                while last < count and (last == first or batch + ranges.ranges[last][1] <= BATCH_BYTES):
                    batch += ranges.ranges[last][1]
                    last += 1
                views = self._batch(fetch, head, ranges.ranges[first:last], what)
                for k in range(last - first):
                    bases[k] = _address(views[k])
                end_piece = piece
                while end_piece < ranges.n and ranges.pieces[end_piece].range < last:
                    end_piece += 1
                ranges.copy_from(piece, end_piece, bases, first)
                piece, first = end_piece, last
        finally:
            free(bases)

    cdef _run_ranges_into(self, object fetch_into, object head, _ReadPlan plan, object what):
        """Carry out a read plan by ``fetch_into(ranges, buffers)``, which puts each
        range's bytes into its buffer and returns how many it put: the plan's runs of
        DIRECT_BYTES or more (neighbours in the file and in memory) are fetched
        straight into their arrays, each a range of its own (the fetcher joins
        neighbours into shared requests), the rest coalesced as `_range_plan` does into
        a staging buffer of at most BATCH_BYTES a call. The runs go in the first call,
        with the first staged batch, so the fetcher keeps every request busy to the
        end of the plan; nothing is copied twice, and bytes the first request brought
        are not asked again."""
        cdef _ReadPlan staged = _ReadPlan.__new__(_ReadPlan)
        direct = _direct_runs(plan, staged)
        cdef _RangePlan ranges = _range_plan(staged)
        cdef Py_ssize_t first = 0, last, piece = 0, end_piece, count = len(ranges.ranges)
        cdef Py_ssize_t cached = len(head), k
        cdef uint64_t batch, offset, length, at, known
        cdef uintptr_t destination
        cdef const char** bases = NULL
        cdef char* staging_at
        staging = None
        try:
            bases = <const char**>malloc(max(count, 1) * sizeof(char*))
            if bases == NULL:
                raise MemoryError()
            while first < count or direct:
                last, batch = first, 0
                while last < count and (last == first or batch + ranges.ranges[last][1] <= BATCH_BYTES):
                    batch += ranges.ranges[last][1]
                    last += 1
                if staging is None or <uint64_t>len(staging) < batch:
                    staging = np.empty(batch, np.uint8)
                staging_at = <char*>cnp.PyArray_DATA(staging)
                asked, buffers = [], []
                for offset, length, destination in direct:
                    if offset < <uint64_t>cached:    # its start came with the header
                        known = min(<uint64_t>cached - offset, length)
                        memcpy(<char*>destination, PyBytes_AS_STRING(head) + offset, known)
                        if known == length:
                            continue
                        offset, length = offset + known, length - known
                        destination += known
                    asked.append((offset, length))
                    buffers.append(PyMemoryView_FromMemory(<char*>destination, length,
                                                           PyBUF_WRITE))
                at = 0
                for k in range(first, last):
                    offset, length = ranges.ranges[k]
                    if offset + length <= <uint64_t>cached:
                        bases[k - first] = PyBytes_AS_STRING(head) + offset
                        continue
                    bases[k - first] = staging_at + at
                    asked.append((offset, length))
                    buffers.append(memoryview(staging)[at:at + length])
                    at += length
                direct = []
                self._checked_fetch_into(fetch_into, asked, buffers, what)
                end_piece = piece
                while end_piece < ranges.n and ranges.pieces[end_piece].range < last:
                    end_piece += 1
                ranges.copy_from(piece, end_piece, bases, first)
                piece, first = end_piece, last
        finally:
            free(bases)

    cdef _checked_fetch_into(self, object fetch_into, list ranges, list buffers,
                             object what):
        """fetch_into(ranges, buffers), each range checked to have filled its buffer:
        fewer bytes (a short read) is an error naming whose bytes are missing. The
        buffers are released when it returns: a fetcher may not keep them."""
        if not ranges:
            return
        try:
            got = fetch_into(ranges, buffers)
        finally:
            for view in buffers:
                view.release()
        if not isinstance(got, (list, tuple)) or len(got) != len(ranges):
            given = (f"{len(got)} of them" if isinstance(got, (list, tuple))
                     else f"a {type(got).__name__}")
            raise SafetensorError(f"{self.source}: fetch_into must return a list of one byte "
                                  f"count per range ({len(ranges)}), got {given}")
        for (offset, length), count in zip(ranges, got):
            if type(count) is not int or count != length:
                _fail(self.source, f"{self._holder(offset, what)}: bytes [{offset}, "
                                   f"{offset + length}) came back {_shown(count)} bytes long, "
                                   f"not {length} ("
                                   f"{'a short read' if type(count) is int and count < length else 'too long'})")

    cdef list _batch(self, object fetch, object head, list batch, object what):
        """The bytes of each range of `batch`: from the first request's when they hold
        it, else fetched (all those in one call)."""
        cdef Py_ssize_t cached = len(head)
        wanted = [r for r in batch if r[0] + r[1] > cached]
        fetched = iter(self._checked_fetch(fetch, wanted, what) if wanted else ())
        head_view = memoryview(head)
        return [head_view[r[0]:r[0] + r[1]] if r[0] + r[1] <= cached else next(fetched)
                for r in batch]

    cdef inline _check_open(self):
        if fastst_load_int(<int*>&self.is_closed):   # close() may be running in another thread
            raise SafetensorError(f"{self.source}: file is closed")

    cdef object _held_owner(self):
        """The owner of the data (None: pread and ranges), in a local reference:
        another thread's close() cannot unmap the memory while it is used. Taken in
        a critical section: without the GIL, close() could free the owner between
        the read of the field and the new reference. SafetensorError when closed."""
        with cython.critical_section(self):
            owner = self.owner
        if owner is None:
            self._check_open()
        return owner

    cdef Py_ssize_t _position(self, name) except -1:
        self._check_open()
        position = self.header.index().get(name)
        if position is None:
            raise TensorNotFoundError(f"{self.source}: no tensor named {_shown(name)}")
        return position

    cdef object _array(self, Py_ssize_t i):
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        cdef int ndim = entry.np_ndim
        if ndim < 0:
            _fail(self.source, f"tensor {_shown(h.names[i])}: shape {_shown(h.shape(i))} cannot be a NumPy "
                               f"array (NumPy allows {MAX_DIMS} dims, each below 2**63, whose "
                               f"nonzero product in bytes stays below 2**63)")
        if self.kind == BACKEND_PREAD or self.kind == BACKEND_RANGES:
            return self._pread_array(i)
        descr = self._dtype_of(entry.code)
        owner = self._held_owner()
        Py_INCREF(descr)
        try:
            array = PyArray_NewFromDescr(
                &PyArray_Type, <Descr*><PyObject*>descr, ndim, h.numpy_dims(entry), NULL,
                self.data + entry.begin, cnp.NPY_ARRAY_WRITEABLE if self.writable else 0, NULL)
        except ValueError as error:
            _fail(self.source, f"tensor {_shown(h.names[i])}: shape {_shown(h.shape(i))} cannot be a NumPy "
                               f"array ({error})")
        cnp.set_array_base(array, owner)
        return array

    cdef object _pread_array(self, Py_ssize_t i, Py_ssize_t first=0, Py_ssize_t last=-1):
        """Read tensor i into fresh memory: all of it, or rows [first, last) of its
        first axis when `last` is given."""
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        cdef cnp.npy_intp[64] dims
        memcpy(dims, h.numpy_dims(entry), entry.np_ndim * sizeof(cnp.npy_intp))
        cdef uint64_t length = entry.end - entry.begin
        cdef uint64_t skip = 0
        if last >= 0:
            if dims[0] > 0:
                skip = first * (length // dims[0])
                length = (last - first) * (length // dims[0])
            dims[0] = last - first
        cdef cnp.ndarray array = self._empty_with(i, dims)
        cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
        plan.add(<char*>cnp.PyArray_DATA(array), length, self.data_offset + entry.begin + skip)
        self._run(plan, h.names[i])
        return array

    def read_rows(self, name, Py_ssize_t first, Py_ssize_t last):
        """Rows ``[first, last)`` of tensor `name`'s first axis."""
        cdef Py_ssize_t i = self._position(name)
        cdef Entry* entry = &self.header.entries[i]
        if entry.np_ndim < 1 or not 0 <= first <= last <= self.header.numpy_dims(entry)[0]:
            raise IndexError(f"rows [{first}, {last}) out of range for tensor {_shown(name)}")
        if self.kind == BACKEND_PREAD or self.kind == BACKEND_RANGES:
            return self._pread_array(i, first, last)
        self._advise_part(i, last > first, (last - first)
                          * _row_bytes(entry, self.header.numpy_dims(entry)[0]))
        return self._array(i)[first:last]

    @property
    def backend(self):
        """How tensors are served: ``"mmap"``, ``"pread"``, ``"ranges"`` (URLs and
        file objects) or ``"buffer"``."""
        return ("mmap", "pread", "buffer", "ranges")[self.kind]

    cdef _release_fd(self):
        """Close the pread backend's descriptor, once: close() and the last read in
        flight may both come here."""
        cdef int fd = fastst_exchange_int(&self.fd, -1)
        if fd >= 0:
            os.close(fd)

    def get_tensor(self, name, *, out=None):
        """Tensor `name` as a NumPy array."""
        cdef Py_ssize_t i = self._position(name)
        if out is None:
            self._read_around(i)
            return self._array(i)
        self._fill([(i, out)])
        return out

    def get_part(self, name, index, rows=None):
        """``get_tensor(name)[index]``, for a part of a tensor: what a slice's
        indexing gives with the ``"mmap"`` backend (see ``SafeSlice``)."""
        cdef Py_ssize_t i = self._position(name)
        cdef uint64_t runs, run
        cdef Entry* entry = &self.header.entries[i]
        tensor = self._array(i)
        if rows is not None:
            if self.kind == BACKEND_MMAP and entry.np_ndim > 0:
                rows = np.ascontiguousarray(rows, np.intp)
                runs = _runs(rows)    # of adjacent rows: each a run of bytes
                run = _row_bytes(entry, self.header.numpy_dims(entry)[0])
                self._advise_part(i, runs, run * len(rows) // max(runs, 1))
            return tensor[index]
        part = tensor[index]
        if (self.kind == BACKEND_MMAP and cnp.PyArray_Check(part)
                and cnp.PyArray_BASE(<cnp.ndarray>part) == <PyObject*>tensor):
            runs = _runs_of_view(<cnp.ndarray>part, &run)
            self._advise_part(i, runs, run)
        return part

    cdef _read_around(self, Py_ssize_t i):
        """Tensor i handed out whole, as a view: its range of the map read as the
        kernel reads a map by default, where a partial read advised it otherwise."""
        cdef bint advised_random
        if not fastst_load_int(&self.advised):  # no partial read advised any range
            return
        with cython.critical_section(self):     # see _advise
            advised_random = self.advice is not None and self.advice[i] == ADVISED_RANDOM
        if advised_random:
            self._advise(i, False)

    cdef _advise_part(self, Py_ssize_t i, uint64_t runs, uint64_t run):
        """Advise tensor i's range of the map for a read of `runs` runs of `run` bytes
        apart in it: faults that read the page they touch alone (MADV_RANDOM) where
        the runs are short beside the kernel's read-around (at most 1/32 of it: a
        fault a page costs less than one read-around) and touch at most a quarter of
        the tensor's pages; else the kernel's read-around, which reads what the runs
        touch in fewer, larger requests. Measured (bench/partial.py): 1,000 random
        256-byte rows of a 977 MiB tensor read 4 MiB from the disk so, 962 MiB
        with read-around (read_ahead_kb 8192); a 256 MiB view touched in order took
        13x longer with MADV_RANDOM than with read-around."""
        cdef Entry* entry = &self.header.entries[i]
        if (self.kind != BACKEND_MMAP or fastst_load_int(<int*>&self.advice_fixed)
                or runs == 0 or run == 0):
            return      # nothing is touched: nothing to advise
        cdef uint64_t read_around = fastst_load_u64(&self.read_around)   # threads share it
        if read_around == 0:
            read_around = _readahead_bytes(self.file_dev)
            fastst_store_u64(&self.read_around, read_around)
        cdef uint64_t pages = (entry.end - entry.begin) // FASTST_PAGE
        self._advise(i, run * 32 <= read_around and runs <= pages
                        and runs * (run // FASTST_PAGE + 2) * 4 <= pages)

    cdef _advise(self, Py_ssize_t i, bint random):
        """Advise tensor i's range of the map (see _Mapping.read_ahead_on_faults_in)
        when its advice changes."""
        cdef unsigned char wanted = ADVISED_RANDOM if random else ADVISED_READ_AROUND
        cdef Entry* entry = &self.header.entries[i]
        cdef bint closed
        with cython.critical_section(self):     # the owner (see _held_owner), and the advice
            owner = self.owner                  # that threads share: made once, given once
            closed = owner is None or self.advice_fixed
            if not closed and self.advice is None:
                self.advice = bytearray(len(self.header.names))
                fastst_store_int(&self.advised, True)
            if not closed and self.advice[i] != wanted:
                (<_Mapping>owner).read_ahead_on_faults_in(self.data + entry.begin,
                                                          self.data + entry.end, not random)
                self.advice[i] = wanted

    def copy_tensors(self):
        """Every tensor, in buffer order, each read into fresh memory of its own."""
        self._check_open()
        cdef _Header h = self.header
        cdef Py_ssize_t n = len(h.names)
        cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
        what = h.names[0] if n == 1 else n
        if self.kind != BACKEND_MMAP and self.kind != BACKEND_PREAD:
            arrays = self._fresh_arrays(plan)
            self._run(plan, what)
            return dict(zip(h.names, arrays))
        self._begin_file_plan(plan)
        try:
            if n:
                plan.prime(self.data_offset + h.entries[0].begin,
                           self.data_offset + h.entries[n - 1].end)
            arrays = self._fresh_arrays(plan)
            self._read_file(plan)
        finally:
            self._end_file_plan(plan)
        plan.raise_if_failed(self.source, what)
        return dict(zip(h.names, arrays))

    cdef list _fresh_arrays(self, _ReadPlan plan):
        """A fresh array for every tensor, in buffer order, each added to `plan`."""
        cdef _Header h = self.header
        cdef Py_ssize_t i
        cdef Entry* entry
        cdef cnp.ndarray array
        arrays = []
        for i in range(len(h.names)):
            array = self._empty(i)
            entry = &h.entries[i]
            plan.add(<char*>cnp.PyArray_DATA(array), entry.end - entry.begin,
                     self.data_offset + entry.begin)
            arrays.append(array)
        return arrays

    def will_need(self, names):
        """Ask the kernel to start reading tensors into the page cache, and return."""
        positions = sorted(self._position(name) for name in names)
        cdef Entry* entry
        spans = []
        for i in positions:
            entry = &self.header.entries[<Py_ssize_t>i]
            begin, end = self.data_offset + entry.begin, self.data_offset + entry.end
            last = spans[len(spans) - 1] if spans else None
            if last is not None and begin <= last[1]:
                last[1] = max(last[1], end)
            elif end > begin:
                spans.append([begin, end])
        return self._will_need(spans)

    def prefetch_rows(self, name, Py_ssize_t first, Py_ssize_t stop):
        """Ask the kernel to start reading rows ``[first, stop)`` of tensor
        `name`'s first axis (clipped to it) into the page cache, as `will_need`
        does whole tensors (the thread ``Loader`` asks it of the blocks of a
        block shuffle over more than half the memory; see `cache_rows`). The
        number of bytes asked for: 0 for a buffer or a file read by ranges."""
        span = self._rows_span(name, first, stop)
        return 0 if span is None else self._will_need([span])

    def cache_rows(self, name, Py_ssize_t first, Py_ssize_t stop):
        """Read rows ``[first, stop)`` of tensor `name`'s first axis (clipped to
        it) into the page cache now, without the GIL, and return once they are
        there (the thread ``Loader`` reads a shuffle's blocks so)."""
        span = self._rows_span(name, first, stop)
        if span is None or self.kind == BACKEND_BUFFER or self.kind == BACKEND_RANGES:
            return 0
        cdef uint64_t begin = span[0], end = span[1], size = self.file_size
        cdef int error
        if self._pieces_held(begin, end):
            return end - begin
        fd = self._reopen()     # the page cache is the file's, whichever descriptor reads
        try:
            if begin < FASTST_HUGE_PAGE and not self.first_piece_ready:
                self._prepare_first_piece(fd)
            with nogil:
                error = fastst_cache_span(fd, begin, end, size)
        finally:
            os.close(fd)
        if error == ENOSYS or error == EINVAL:      # no MADV_POPULATE_READ in this kernel
            return self._will_need([span])
        if error == EFAULT:
            _fail(self.source, f"file was truncated under the reader (it had {size} "
                               f"bytes when opened)")
        if error != 0:
            raise OSError(error, f"{os.strerror(error)}: reading rows of "
                                 f"{_shown(name)} into the page cache", self.source)
        _count(COUNT_ROWS_CACHED, 1)
        return end - begin

    def rows_cached(self, name, Py_ssize_t first, Py_ssize_t stop):
        """Whether `cache_rows` would find rows ``[first, stop)`` of tensor
        `name` held already and read nothing: the page cache holds the first
        and the last page of every 2 MiB piece that holds them (asked of the
        file's map, without the GIL). A tensor it cannot read rows of raises
        as in `cache_rows`."""
        span = self._rows_span(name, first, stop)
        if span is None or self.kind == BACKEND_BUFFER or self.kind == BACKEND_RANGES:
            return True
        return self._pieces_held(span[0], span[1])

    cdef bint _pieces_held(self, uint64_t begin, uint64_t end):
        """Whether the page cache holds the pieces of the file's bytes [begin, end)
        (fastst_pieces_cached), asked of the map; without a map: False."""
        if self.kind != BACKEND_MMAP:
            return False
        owner = self._held_owner()      # kept: a close meanwhile leaves the map in place
        cdef char* mapped = <char*>(<_Mapping>owner).addr
        cdef uint64_t size = self.file_size
        cdef int held
        with nogil:
            held = fastst_pieces_cached(mapped, begin, end, size)
        return held != 0

    cdef _prepare_first_piece(self, int fd):
        """Before the first read of the file's first 2 MiB piece (through `fd`, the
        caller's descriptor of the file): the header's pages, read at open, are small
        pages at its start that would keep it from being read as one folio, mapped by
        one entry; they are dropped (with the rest of the piece where it is held in
        part: fastst_drop_partial_first_piece). Once a reader, under a lock that every
        first read of the piece waits for, so that no thread's read of it is dropped."""
        with cython.critical_section(self):     # one for all threads, made once
            if self.first_piece_lock is None:
                self.first_piece_lock = _thread.allocate_lock()
            lock = self.first_piece_lock
        cdef uint64_t size = self.file_size
        with lock:
            if self.first_piece_ready:
                return
            with nogil:
                fastst_drop_partial_first_piece(fd, size)
            self.first_piece_ready = True

    def read_ahead_on_faults(self, bint on):
        """Whether a fault on the file's map that reads from the file reads
        ahead of the page it touches, as the kernel does by default (`on`), or
        reads that page alone (``MADV_RANDOM``). A reader whose rows are read
        into the page cache by `cache_rows`, in the order they are needed,
        turns it off: the read ahead that a gather's first touch of a piece
        starts would read the pieces after it before those needed next."""
        self._check_open()
        if self.kind != BACKEND_MMAP:
            return False
        with cython.critical_section(self):     # see _advise
            # kept: no partial read advises a tensor's range after this
            fastst_store_int(<int*>&self.advice_fixed, True)
            self.advice = None
            fastst_store_int(&self.advised, False)
        return (<_Mapping>self._held_owner()).read_ahead_on_faults(on)

    cdef object _rows_span(self, name, Py_ssize_t first, Py_ssize_t stop):
        """The file's bytes [begin, end) of rows [first, stop) of tensor `name`'s first
        axis, clipped to it; None when none."""
        cdef Py_ssize_t i = self._position(name)
        cdef Entry* entry = &self.header.entries[i]
        if entry.np_ndim < 1:
            raise IndexError(f"tensor {_shown(name)} has no axis to read rows of")
        cdef cnp.npy_intp count = self.header.numpy_dims(entry)[0]
        cdef uint64_t row_bytes = _row_bytes(entry, count)
        first, stop = max(first, 0), min(stop, count)
        if stop <= first or row_bytes == 0:
            return None
        begin = self.data_offset + entry.begin + first * row_bytes
        return [begin, begin + (stop - first) * row_bytes]

    cdef _will_need(self, list spans):
        """posix_fadvise(WILLNEED) over byte spans [begin, end) of a local file, in
        pieces that the kernel reads whole: it reads no more than the device's
        read-ahead limit of one call (_readahead_bytes) and drops the rest. The
        bytes asked for: none where the system takes no such advice (macOS)."""
        if (self.kind == BACKEND_BUFFER or self.kind == BACKEND_RANGES or not spans
                or not hasattr(os, "posix_fadvise")):
            return 0
        piece = _readahead_bytes(self.file_dev)
        fd = self._reopen()     # the page cache is the file's, whichever descriptor asks
        try:
            for begin, end in spans:
                while begin < end:
                    stop = min(end, (begin // piece + 1) * piece)    # on multiples of piece
                    os.posix_fadvise(fd, begin, stop - begin, os.POSIX_FADV_WILLNEED)
                    begin = stop
        finally:
            os.close(fd)
        return sum(end - begin for begin, end in spans)

    def read_into(self, dict arrays):
        """Read the named tensors into caller-supplied arrays, allocating nothing."""
        self._fill([(self._position(name), out) for name, out in arrays.items()])

    cdef object _empty(self, Py_ssize_t i):
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        if entry.np_ndim < 0:
            self._array(i)   # raises the error that says why
        return self._empty_with(i, h.numpy_dims(entry))

    cdef object _empty_with(self, Py_ssize_t i, cnp.npy_intp* dims):
        """A fresh array of tensor i's dtype and ndim, with the given dims."""
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        descr = self._dtype_of(entry.code)
        Py_INCREF(descr)
        try:
            return _fresh_array(entry.np_ndim, dims, descr)
        except ValueError as error:
            _fail(self.source, f"tensor {_shown(h.names[i])}: shape {_shown(h.shape(i))} cannot be a NumPy "
                               f"array ({error})")

    cdef _fill(self, list targets):
        """Copy tensors into (position, array) targets, with the GIL released: pread
        from the file in chunks shared by threads, or memcpy from a caller's buffer."""
        self._check_open()
        cdef _Header h = self.header
        cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
        cdef Entry* entry
        cdef cnp.ndarray out
        for i, target in targets:
            entry = &h.entries[<Py_ssize_t>i]
            out = _checked_out(self.source, h.names[i], target, self._empty_like(i))
            plan.add(<char*>cnp.PyArray_DATA(out), entry.end - entry.begin,
                     self.data_offset + entry.begin)
        self._run(plan, h.names[targets[0][0]] if len(targets) == 1 else len(targets))

    def gather_rows(self, name, cnp.ndarray[cnp.npy_intp, ndim=1] rows not None):
        """Rows `rows` of tensor `name`'s first axis, each read into its place in
        a fresh array, and no other: the rows must be an ``intp`` array, each in
        range, in any order, repeats allowed (`gather` takes any integers)."""
        cdef Py_ssize_t i = self._position(name), k
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        if entry.np_ndim < 1:
            raise IndexError(f"tensor {_shown(name)} has no axis to gather rows from")
        cdef cnp.npy_intp[64] dims
        memcpy(dims, h.numpy_dims(entry), entry.np_ndim * sizeof(cnp.npy_intp))
        cdef cnp.npy_intp count = dims[0]
        cdef uint64_t row_bytes = _row_bytes(entry, count)
        for k in range(rows.shape[0]):
            if not 0 <= rows[k] < count:
                raise IndexError(f"row {rows[k]} out of range for tensor {_shown(name)}")
        dims[0] = rows.shape[0]
        cdef cnp.ndarray out = self._empty_with(i, dims)
        cdef char* dest = <char*>cnp.PyArray_DATA(out)
        cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
        for k in range(rows.shape[0]):
            plan.add(dest + k * row_bytes, row_bytes,
                     self.data_offset + entry.begin + rows[k] * row_bytes)
        self._run(plan, name)
        return out

    def gather(self, name, rows, out=None):
        """Rows `rows` of tensor `name`'s first axis, copied in their order: a batch
        of a data set in one call."""
        cdef Py_ssize_t i = self._position(name)
        cdef _Header h = self.header
        cdef Entry* entry = &h.entries[i]
        if entry.np_ndim < 0:
            self._array(i)   # raises the error that says why
        if entry.np_ndim == 0:
            raise SafetensorIndexError(f"{self.source}: tensor {_shown(name)} is 0-d: it has "
                                       f"no rows to gather")
        cdef cnp.npy_intp[64] dims
        memcpy(dims, h.numpy_dims(entry), entry.np_ndim * sizeof(cnp.npy_intp))
        cdef cnp.npy_intp count = dims[0]
        cdef cnp.ndarray wanted = _row_indices(self.source, name, rows, count)
        dims[0] = wanted.shape[0]
        if out is None:
            out = self._empty_with(i, dims)
        else:
            shape = tuple([dims[k] for k in range(entry.np_ndim)])
            _checked_out(self.source, name, out, (shape, self._dtype_of(entry.code)))
        cdef uint64_t row_bytes = _row_bytes(entry, count)
        cdef uint64_t start = self.data_offset + entry.begin
        if self.kind == BACKEND_PREAD or self.kind == BACKEND_RANGES:
            self._gather_read(name, wanted, out, row_bytes, start)
        else:
            runs = _runs(wanted)    # of adjacent rows: each a run of bytes
            self._advise_part(i, runs, row_bytes * wanted.shape[0] // max(runs, 1))
            self._gather_copy(name, wanted, out, row_bytes, start)
        return out

    cdef _gather_copy(self, object name, cnp.ndarray wanted, cnp.ndarray out,
                      uint64_t row_bytes, uint64_t start):
        """Mapped file or buffer: memcpy each row from memory. A mapped file is first
        checked to be the one mapped, no shorter; one cut short during the copy ends
        it (a guarded copy): a SafetensorError either way, never a fault."""
        owner = self._held_owner()     # holds the memory while the GIL is released
        if self.kind == BACKEND_MMAP:
            os.close(self._reopen())
        _rows_plan(wanted, <char*>cnp.PyArray_DATA(out), row_bytes, start).copy_from(
            self.data - self.data_offset, self.source, name)

    cdef _gather_read(self, object name, cnp.ndarray wanted, cnp.ndarray out,
                      uint64_t row_bytes, uint64_t start):
        """pread backend: rows are read straight into `out`, each run of rows adjacent
        in both in one call; unless sorting the rows would at least halve the calls
        (repeats, or rows adjacent out of order): then each run of the distinct rows,
        sorted, is read once, in one call, and its rows put in their places."""
        distinct = np.unique(wanted)
        if _runs(distinct) * 2 > _runs(wanted):
            self._run(_rows_plan(wanted, <char*>cnp.PyArray_DATA(out), row_bytes, start), name)
            return
        places = np.searchsorted(distinct, wanted)
        staged = np.empty(distinct.shape[0] * row_bytes, np.uint8)
        self._run(_rows_plan(distinct, <char*>cnp.PyArray_DATA(staged), row_bytes, start), name)
        _scatter_rows(staged, np.ascontiguousarray(places, np.intp), out, row_bytes)

    @property
    def file_identity(self):
        """The version of the file opened: for a local file ``(absolute path,
        st_dev, st_ino, st_size, st_mtime_ns)`` as it was when opened, for a URL
        the object's URL, size, ETag and modification time; None for a buffer.
        Another handle on the same, unchanged file has the same identity."""
        if self.kind == BACKEND_BUFFER:
            return None
        if self.kind == BACKEND_RANGES:
            return self.identity
        return (self.path, self.file_dev, self.file_ino, self.file_size, self.file_mtime_ns)

    cdef _run(self, _ReadPlan plan, object what):
        """Carry out a read plan: pread from the file, or memcpy from a buffer.
        `what`, for errors: the tensor's name, or how many tensors the plan reads."""
        if self.kind == BACKEND_BUFFER:
            plan.copy_from(self.data - self.data_offset, self.source, what)
            return
        if self.kind == BACKEND_RANGES:
            self._run_ranges(plan, what)
            return
        self._begin_file_plan(plan)
        try:
            self._read_file(plan)
        finally:
            self._end_file_plan(plan)
        plan.raise_if_failed(self.source, what)

    cdef _begin_file_plan(self, _ReadPlan plan):
        """Give a plan on a local file its descriptor: the mapped file opened again
        (mmap), or the reader's own, counted busy so that close() leaves it open
        until _end_file_plan (pread)."""
        if self.kind == BACKEND_MMAP:
            self._check_open()
            plan.fd = self._reopen()
            return
        # No lock: threads sharing a handle would take turns at it (see kernels.h)
        fastst_add_int_ordered(&self.busy, 1)
        if fastst_load_int_ordered(<int*>&self.is_closed):
            self._end_busy()
            self._check_open()
        plan.fd = self.fd

    cdef _end_file_plan(self, _ReadPlan plan):
        plan.stop_priming()     # before the descriptor it reads goes
        if self.kind == BACKEND_MMAP:
            os.close(plan.fd)
            return
        self._end_busy()

    cdef _end_busy(self):
        if (fastst_add_int_ordered(&self.busy, -1) == 0
                and fastst_load_int_ordered(<int*>&self.is_closed)):
            self._release_fd()

    cdef _read_file(self, _ReadPlan plan):
        """pread the plan from plan.fd: hinted, shared by threads, and with O_DIRECT
        where read_options() asks for it and the file system takes it."""
        cdef bint hinted = plan.hint()
        plan.threads = self.plan_threads
        if _direct_option() and plan.total >= plan.chunk:     # else the cache is as good
            plan.direct_fd = self._open_direct()
        try:
            plan.run_threaded()
        finally:
            if plan.direct_fd >= 0:
                os.close(plan.direct_fd)
                plan.direct_fd = -1
            if hinted and plan.fd == self.fd:
                # the pread backend's descriptor serves later reads, rows at random too
                fastst_advise_file(plan.fd, 0, 0, FASTST_ADVISE_NORMAL)

    cdef int _open_direct(self) except -2:
        """The opened file again with O_DIRECT, checked to be that file; -1 where the
        platform or the file system refuses it (tmpfs does): reads then go through
        the page cache, and read_counters() counts the refusal."""
        flag = getattr(os, "O_DIRECT", 0)
        try:
            if not flag:
                raise OSError(EINVAL, "O_DIRECT is not supported on this platform")
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | flag)
        except OSError as error:
            if error.errno not in (EINVAL, EOPNOTSUPP):
                raise
            _count(COUNT_DIRECT_REFUSED, 1)
            return -1
        info = os.fstat(fd)
        if <uint64_t>info.st_dev != self.file_dev or <uint64_t>info.st_ino != self.file_ino:
            os.close(fd)
            _fail(self.source, "file was replaced since it was opened; open it again "
                               "to read the new file")
        return fd

    def _ring_part(self, tuple names):
        """What the loader's ring (fastst._core._ring) gathers from this mapped file:
        (address of its first row, rows, bytes a row) of each tensor of `names`, a
        new descriptor on the file (refused where the file changed since it was
        opened), the file's size when opened, and the map the addresses point into."""
        if self.kind != BACKEND_MMAP:
            raise ValueError("a ring gathers from mapped files only")
        cdef Py_ssize_t i
        cdef Entry* entry
        cdef cnp.npy_intp count
        tensors = []
        for name in names:
            i = self._position(name)
            entry = &self.header.entries[i]
            if entry.np_ndim < 1:
                raise ValueError(f"tensor {_shown(name)} has no rows")
            count = self.header.numpy_dims(entry)[0]
            tensors.append((<uintptr_t>(self.data + entry.begin), count,
                            _row_bytes(entry, count)))
        return tensors, self._reopen(), self.file_size, self.owner

    def _reopened(self):
        """A new descriptor on the file: a SafetensorError says what changed where it
        changed since it was opened (see _reopen)."""
        return self._reopen()

    cdef int _reopen(self) except -1:
        """A descriptor on the mapped file, for one copy. Copies read with pread rather
        than from the map, so that a file that shrank gives a short read and a clear
        error where the map would fault (SIGBUS). The handle keeps no descriptor, so
        the path is opened again and must still name the mapped file, no shorter."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if <uint64_t>info.st_dev != self.file_dev or <uint64_t>info.st_ino != self.file_ino:
                _fail(self.source, "file was replaced since it was opened; open it again "
                                   "to read the new file")
            if <uint64_t>info.st_size < self.file_size:
                _fail(self.source, f"file was truncated under the reader ({info.st_size} "
                                   f"bytes, {self.file_size} when opened)")
        except BaseException:
            os.close(fd)
            raise
        return fd

    cdef object _empty_like(self, Py_ssize_t i):
        """What an `out` array for tensor i must match: (shape, dtype)."""
        shape = self._numpy_shape(i)
        if shape is None:
            self._array(i)   # raises the error that says why
        return shape, self._dtype_of(self.header.entries[i].code)

    cdef object _numpy_shape(self, Py_ssize_t i):
        """The shape of tensor i's NumPy array (packed for sub-byte dtypes), or None
        when its shape cannot be a NumPy array."""
        cdef Entry* entry = &self.header.entries[i]
        if entry.np_ndim < 0:
            return None
        cdef cnp.npy_intp* dims = self.header.numpy_dims(entry)
        return tuple([dims[k] for k in range(entry.np_ndim)])

    def __getitem__(self, name):
        cdef Py_ssize_t i = self._position(name)
        self._read_around(i)
        return self._array(i)

    def get_tensors(self):
        """Every tensor, in buffer order, as `get_tensor` gives each."""
        self._check_open()
        if self.kind == BACKEND_RANGES or self.kind == BACKEND_PREAD:
            return self.copy_tensors()
        cdef Py_ssize_t i
        names = self.header.names
        if self.kind == BACKEND_MMAP:
            if fastst_load_int(&self.advised):
                for i in range(len(names)):
                    self._read_around(i)
            self._read_map_ahead()
        return {names[i]: self._array(i) for i in range(len(names))}

    cdef _read_map_ahead(self):
        """Every tensor of a mapped file asked for at once: unless read_options() turned
        hints off, or their span is under two requests, a thread maps their pages in
        the background, in file order (see _Mapping.read_ahead), so that the disk
        streams them while the caller works on the first ones, where each touch of a
        page not yet read waited for the disk."""
        cdef _Header h = self.header
        cdef Py_ssize_t n = len(h.names)
        if not _hints_option() or n == 0:
            return
        cdef char* begin = self.data + h.entries[0].begin
        cdef char* end = self.data + h.entries[n - 1].end
        if <uint64_t>(end - begin) >= 2 * _chunk_option():
            (<_Mapping>self._held_owner()).read_ahead(begin, end)

    def keys(self):
        """The names of the file's tensors, sorted."""
        self._check_open()
        return list(self.header.sorted_names())

    def offset_keys(self):
        """The names of the file's tensors, in the order of their bytes in the file."""
        self._check_open()
        return list(self.header.names)

    def metadata(self):
        """The file's ``__metadata__``: a dict of str to str, or None when it has none."""
        self._check_open()
        metadata = self.header.metadata
        return None if metadata is None else dict(metadata)

    def info(self, name):
        """What the header says of tensor `name`, read without touching its bytes."""
        cdef Py_ssize_t i = self._position(name)
        cdef Entry* entry = &self.header.entries[i]
        return _record("TensorInfo")(DTYPE_CODES[entry.code], self.header.shape(i),
                                     (entry.begin, entry.end), self._numpy_shape(i))

    @property
    def data_start(self):
        """Where the tensor data starts in the file (or buffer): 8 + the header's
        length."""
        return self.data_offset

    def __len__(self):
        self._check_open()
        return len(self.header.names)

    def __contains__(self, name):
        self._check_open()
        return name in self.header.index()

    def __iter__(self):
        return iter(self.keys())

    @property
    def closed(self):
        """Whether ``close()`` was called; a closed handle reads nothing more."""
        return bool(fastst_load_int(<int*>&self.is_closed))

    def close(self):
        """Let go of the file: the handle reads nothing more, and arrays it gave
        stay valid (a view keeps the map alive). Closing again does nothing."""
        with cython.critical_section(self):     # see _held_owner
            fastst_store_int_ordered(<int*>&self.is_closed, True)
            self.owner = None   # `data` stays set: in-flight reads hold the owner themselves
            self.fetch = self.head = None
        if fastst_load_int_ordered(&self.busy) == 0:   # else the last read in flight closes it
            self._release_fd()

    def __dealloc__(self):
        if self.fd >= 0:
            os.close(self.fd)


# The least that one posix_fadvise(WILLNEED) reads whole on Linux: the kernel's default
# read-ahead (128 KiB), where sysfs does not tell a device's own limit.
MIN_READAHEAD_BYTES = 128 << 10
cdef dict _READAHEAD_BYTES = {}     # st_dev -> its limit, read from sysfs once


def _readahead_bytes(device):
    """The most bytes that one posix_fadvise(WILLNEED) reads of a file on device
    `device` (an st_dev): Linux reads up to the larger of the device's read-ahead and
    its largest request (sysfs read_ahead_kb, max_sectors_kb), and no more."""
    found = _READAHEAD_BYTES.get(device)
    if found is None:
        found = _READAHEAD_BYTES[device] = _device_readahead_bytes(device)
    return found


def _device_readahead_bytes(device):
    disk = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for queue in (disk + "/queue", disk + "/../queue"):     # a disk's, a partition's disk's
        try:
            limits = []
            for name in ("read_ahead_kb", "max_sectors_kb"):
                with open(f"{queue}/{name}") as limit:
                    limits.append(int(limit.read()) << 10)
        except (OSError, ValueError):
            continue
        return max(MIN_READAHEAD_BYTES, max(limits))
    return MIN_READAHEAD_BYTES


cdef uint64_t _runs_of_view(cnp.ndarray view, uint64_t* run) noexcept:
    """The runs of bytes of a view, and the bytes of each (in `run`): its trailing
    axes that lie together in memory make one run, and each element of the axes
    before them starts one."""
    cdef int k = cnp.PyArray_NDIM(view), axis
    cdef cnp.npy_intp* shape = cnp.PyArray_DIMS(view)
    cdef cnp.npy_intp* strides = cnp.PyArray_STRIDES(view)
    cdef uint64_t runs = 1
    run[0] = cnp.PyArray_ITEMSIZE(view)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == <cnp.npy_intp>run[0]):
        run[0] *= shape[k - 1]
        k -= 1
    for axis in range(k):
        runs *= shape[axis]
    return runs


cdef inline uint64_t _row_bytes(Entry* entry, cnp.npy_intp rows) noexcept:
    """The bytes of one row along the first axis of a tensor of `rows` rows."""
    return (entry.end - entry.begin) // rows if rows else 0


cdef const char* _address(object view) except? NULL:
    """Where a C-contiguous memoryview's bytes start (NULL when it is empty)."""
    cdef const uint8_t[::1] data = view
    return <const char*>&data[0] if data.shape[0] else NULL


cdef inline bint _is_absolute(object path):
    if type(path) is str:
        return (<str>path).startswith("/")
    return (<bytes>path).startswith(b"/")


cdef uint64_t _checked_limit(object value) except? 0:
    """max_header_size as a C integer: a non-negative int (values past 2**64 - 1 set no
    limit)."""
    if type(value) is int and 0 <= value <= UINT64_MAX:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise SafetensorTypeError(f"max_header_size must be an integer, got "
                                  f"{type(value).__name__} {_shown(value)}")
    if value < 0:
        raise SafetensorError(f"max_header_size must not be negative, got {value}")
    return min(value, UINT64_MAX)


cdef cnp.ndarray _checked_out(str source, object name, object out, tuple expected):
    shape, dtype = expected
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out for tensor {_shown(name)} must be a numpy.ndarray, got "
                        f"{type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out for tensor {_shown(name)} must have shape {shape} and dtype {dtype}, "
                         f"got {out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out for tensor {_shown(name)} must be C-contiguous and writable")
    return out



cdef cnp.ndarray _row_indices(str source, object name, object rows, cnp.npy_intp count):
    """`rows` (a 1-d sequence of integers) as a fresh intp array of rows in [0, count),
    negatives counted from the end; SafetensorIndexError for one out of range."""
    cdef cnp.ndarray wanted = _list_of_ints(source, name, rows, count)
    if wanted is None:
        wanted = _integer_array(source, name, rows, count)
    cdef cnp.npy_intp* row = <cnp.npy_intp*>cnp.PyArray_DATA(wanted)
    cdef Py_ssize_t k
    for k in range(wanted.shape[0]):
        if not -count <= row[k] < count:
            raise SafetensorIndexError(f"{source}: tensor {_shown(name)}: row {row[k]} out "
                                       f"of range for {count} rows")
        if row[k] < 0:
            row[k] += count
    return wanted


cdef object _list_of_ints(str source, object name, object rows, cnp.npy_intp count):
    """A list of Python ints as a fresh intp array, without NumPy's conversion of each
    item (the usual batch from a sampler); None for anything else."""
    if type(rows) is not list:
        return None
    cdef list items = <list>rows
    cdef Py_ssize_t k, n = len(items)
    for k in range(n):
        if type(items[k]) is not int:
            return None
    cdef cnp.ndarray wanted = np.empty(n, np.intp)
    cdef cnp.npy_intp* row = <cnp.npy_intp*>cnp.PyArray_DATA(wanted)
    for k in range(n):
        try:
            row[k] = items[k]
        except OverflowError:
            raise SafetensorIndexError(f"{source}: tensor {_shown(name)}: row {_shown(items[k])} "
                                       f"out of range for {count} rows") from None
    return wanted


cdef cnp.ndarray _integer_array(str source, object name, object rows, cnp.npy_intp count):
    try:
        given = np.asarray(rows)
    except (TypeError, ValueError) as error:
        raise SafetensorTypeError(f"{source}: tensor {_shown(name)}: rows must be a 1-d "
                                  f"sequence of integers ({error})") from None
    if given.ndim != 1 or not (given.dtype.kind in "iu" or (given.size == 0 and
                                                               given.dtype.kind == "f")):
        raise SafetensorTypeError(f"{source}: tensor {_shown(name)}: rows must be a 1-d "
                                  f"sequence of integers, got {given.ndim}-d {given.dtype}")
    if given.dtype.kind == "u" and given.size and <uint64_t>given.max() > INTP_MAX:
        raise SafetensorIndexError(f"{source}: tensor {_shown(name)}: row {int(given.max())} "
                                   f"out of range for {count} rows")
    return np.array(given, dtype=np.intp)


cdef _ReadPlan _rows_plan(cnp.ndarray rows, char* dest, uint64_t row_bytes, uint64_t start):
    """Copy row rows[k], found at start + rows[k] * row_bytes, to dest + k * row_bytes:
    rows adjacent in both become one copy."""
    cdef cnp.npy_intp* row = <cnp.npy_intp*>cnp.PyArray_DATA(rows)
    cdef _ReadPlan plan = _ReadPlan.__new__(_ReadPlan)
    cdef Py_ssize_t k
    for k in range(rows.shape[0]):
        plan.add(dest + k * row_bytes, row_bytes, start + row[k] * row_bytes)
    return plan


cdef Py_ssize_t _runs(cnp.ndarray rows):
    """How many runs of consecutive increasing rows `rows` holds."""
    cdef cnp.npy_intp* row = <cnp.npy_intp*>cnp.PyArray_DATA(rows)
    cdef Py_ssize_t k, runs = rows.shape[0] > 0
    for k in range(1, rows.shape[0]):
        runs += row[k] != row[k - 1] + 1
    return runs


cdef _scatter_rows(cnp.ndarray staged, cnp.ndarray places, cnp.ndarray out, uint64_t row_bytes):
    """out row k = staged row places[k], with the GIL released."""
    cdef const char* source = <const char*>cnp.PyArray_DATA(staged)
    cdef char* dest = <char*>cnp.PyArray_DATA(out)
    cdef cnp.npy_intp* place = <cnp.npy_intp*>cnp.PyArray_DATA(places)
    cdef Py_ssize_t k, n = places.shape[0]
    with nogil:
        for k in range(n):
            memcpy(dest + k * row_bytes, source + place[k] * row_bytes, row_bytes)
