# Header decoding and validation (included by __init__.pyx).
#
# Two parsers fill the same compact C arrays. The fast one scans the canonical
# shape of a header byte by byte and accepts only headers it has fully validated;
# anything unusual (escapes, floats, unknown fields, any broken rule) sends the
# header to the strict one, which decodes with orjson (or its equal: fastst._json),
# checks every rule with a precise message, and so decides every error. Both accept exactly the same headers.

cdef struct Entry:
    uint64_t begin              # byte offsets, relative to the tensor buffer
    uint64_t end
    Py_ssize_t dims_at          # the header's dims, in _Header.dims
    Py_ssize_t np_dims_at       # the NumPy view's dims (differ for packed sub-byte dtypes)
    int ndim
    int np_ndim                 # -1: the shape cannot be a NumPy array
    uint8_t code


cdef class _Header:
    """A validated header: tensor entries in buffer order, in compact C arrays;
    Python objects only for names and metadata."""
    cdef readonly str source
    cdef readonly list names          # buffer (offset) order
    cdef PyObject* _index             # dict: name -> position in `names`, built on first
                                      # use and published atomically (a reference held)
    cdef readonly object metadata     # dict or None
    cdef readonly uint64_t data_len
    cdef Entry* entries
    cdef Py_ssize_t n
    cdef Py_ssize_t capacity
    cdef uint64_t* dims
    cdef Py_ssize_t dims_size
    cdef Py_ssize_t dims_capacity
    cdef list _sorted_names

    def __cinit__(self):
        self.names = []

    def __dealloc__(self):
        free(self.entries)
        free(self.dims)
        Py_XDECREF(self._index)

    cdef Entry* add_entry(self) except NULL:
        if self.n == self.capacity:
            self.capacity = _grow(<void**>&self.entries, self.capacity, sizeof(Entry))
        self.n += 1
        return &self.entries[self.n - 1]

    cdef int add_dim(self, uint64_t dim) except -1:
        if self.dims_size == self.dims_capacity:
            self.dims_capacity = _grow(<void**>&self.dims, self.dims_capacity, sizeof(uint64_t))
        self.dims[self.dims_size] = dim
        self.dims_size += 1
        return 0

    cdef list shape(self, Py_ssize_t i):
        cdef Entry* entry = &self.entries[i]
        return [self.dims[entry.dims_at + k] for k in range(entry.ndim)]

    cdef cnp.npy_intp* numpy_dims(self, Entry* entry):
        # np_dims_at entries were checked to be <= INTP_MAX, so they read as npy_intp
        return <cnp.npy_intp*>(self.dims + entry.np_dims_at)

    # Built once, in a critical section, and never replaced after: without the GIL,
    # two threads building it at once would have the second free the first's while
    # the first still reads it. Read without one, as a field that no longer changes.
    def sorted_names(self):
        if self._sorted_names is None:
            with cython.critical_section(self):
                if self._sorted_names is None:
                    self._sorted_names = sorted(self.names)
        return self._sorted_names

    cdef dict index(self):
        cdef PyObject* index = fastst_load_object(&self._index)
        if index == NULL:
            with cython.critical_section(self):
                index = self._index
                if index == NULL:
                    built = {name: k for k, name in enumerate(self.names)}
                    Py_INCREF(built)
                    index = <PyObject*>built
                    fastst_store_object(&self._index, index)
        return <dict>index

    def __len__(self):
        return self.n


cdef Py_ssize_t _grow(void** array, Py_ssize_t capacity, size_t item) except -1:
    cdef Py_ssize_t larger = capacity * 2 if capacity else 16
    cdef void* grown = realloc(array[0], larger * item)
    if grown == NULL:
        raise MemoryError()
    array[0] = grown
    return larger


cdef uint64_t _element_count(_Header h, Entry* entry, bint* overflow) noexcept:
    cdef uint64_t count = 1
    cdef Py_ssize_t k
    overflow[0] = False
    for k in range(entry.ndim):
        if fastst_mul_overflow(count, h.dims[entry.dims_at + k], &count):
            overflow[0] = True
    return count


# ---------------------------------------------------------------------------
# The fast scanner
# ---------------------------------------------------------------------------

cdef struct Cursor:
    const uint8_t* p
    Py_ssize_t pos
    Py_ssize_t n
    bint ascii                  # the last string read was pure ASCII


cdef inline void _skip_space(Cursor* c) noexcept nogil:
    cdef const uint8_t* p = c.p
    cdef Py_ssize_t pos = c.pos, n = c.n
    while pos < n and (p[pos] == 32 or p[pos] == 10 or p[pos] == 13 or p[pos] == 9):
        pos += 1
    c.pos = pos


cdef inline bint _take(Cursor* c, uint8_t token) noexcept nogil:
    if c.pos < c.n and c.p[c.pos] == token:     # the canonical header has no spaces
        c.pos += 1
        return True
    _skip_space(c)
    if c.pos < c.n and c.p[c.pos] == token:
        c.pos += 1
        return True
    return False


cdef inline Py_ssize_t _plain_string(Cursor* c, Py_ssize_t* start) noexcept nogil:
    """Length of the string at the cursor, -1 when there is none or it holds escapes
    or control characters (those go to the strict parser). Notes in `c.ascii`
    whether every byte was ASCII."""
    if not _take(c, 34):
        return -1
    cdef int ascii = 0
    cdef Py_ssize_t end = fastst_string_end(c.p, c.pos, c.n, &ascii)
    if end < 0:
        return -1
    start[0] = c.pos
    c.pos = end + 1
    c.ascii = ascii
    return end - start[0]


cdef uint64_t U64_MAX_TENTH = UINT64_MAX // 10


cdef inline bint _unsigned(Cursor* c, uint64_t* out) noexcept nogil:
    """A JSON integer in 0..2**64-1: no sign, no leading zero, no fraction or exponent."""
    _skip_space(c)
    cdef const uint8_t* p = c.p
    cdef Py_ssize_t start = c.pos, pos = c.pos, n = c.n
    cdef uint64_t value = 0, digit
    while pos < n and 48 <= p[pos] <= 57:
        digit = p[pos] - 48
        if value > U64_MAX_TENTH or (value == U64_MAX_TENTH and digit > UINT64_MAX % 10):
            return False        # past 2**64 - 1
        value = value * 10 + digit
        pos += 1
    if pos == start or (pos - start > 1 and p[start] == 48):
        return False
    if pos < n and (p[pos] == 46 or p[pos] == 101 or p[pos] == 69):
        return False
    c.pos = pos
    out[0] = value
    return True


cdef inline bint _is(Cursor* c, Py_ssize_t start, Py_ssize_t length, const char* word,
                     Py_ssize_t word_length) noexcept nogil:
    return length == word_length and memcmp(c.p + start, word, length) == 0


cdef object _utf8(Cursor* c, Py_ssize_t start, Py_ssize_t length):
    """The string's text, or None when it is not valid UTF-8."""
    cdef object text
    if c.ascii:      # the common case, without the decoder's general machinery
        text = PyUnicode_New(length, 127)
        memcpy(PyUnicode_DATA(text), c.p + start, length)
        return text
    try:
        return PyUnicode_DecodeUTF8(<const char*>c.p + start, length, NULL)
    except UnicodeDecodeError:
        return None


cdef bint _scan_entry(_Header h, Cursor* c, Entry* entry) except -1:
    """The object after a tensor name, '{' already taken: exactly dtype, shape and
    data_offsets, in any order."""
    cdef int seen = 0
    cdef Py_ssize_t start, length
    cdef int code
    cdef uint64_t dim
    while True:
        length = _plain_string(c, &start)
        if length < 0 or not _take(c, 58):
            return False
        if _is(c, start, length, "dtype", 5) and not seen & 1:
            seen |= 1
            length = _plain_string(c, &start)
            code = _code_of(<const char*>c.p + start, length) if length >= 0 else -1
            if code < 0:
                return False
            entry.code = code
        elif _is(c, start, length, "shape", 5) and not seen & 2:
            seen |= 2
            if not _take(c, 91):
                return False
            entry.dims_at = h.dims_size
            if not _take(c, 93):
                while True:
                    if not _unsigned(c, &dim):
                        return False
                    h.add_dim(dim)
                    if _take(c, 44):
                        continue
                    if _take(c, 93):
                        break
                    return False
            entry.ndim = h.dims_size - entry.dims_at
        elif _is(c, start, length, "data_offsets", 12) and not seen & 4:
            seen |= 4
            if not (_take(c, 91) and _unsigned(c, &entry.begin) and _take(c, 44)
                    and _unsigned(c, &entry.end) and _take(c, 93)):
                return False
        else:
            return False
        if _take(c, 44):
            continue
        if _take(c, 125):
            return seen == 7
        return False


cdef bint _entry_is_valid(_Header h, Entry* entry) noexcept:
    cdef bint overflow
    cdef uint64_t nbytes
    cdef uint64_t count = _element_count(h, entry, &overflow)
    return (not overflow
            and fastst_packed_bytes(count, BITS[entry.code], &nbytes) == 0
            and entry.begin <= entry.end
            and entry.end - entry.begin == nbytes)


cdef object _scan_metadata(Cursor* c):
    """The object after "__metadata__", '{' already taken; None to give up."""
    cdef dict metadata = {}
    cdef Py_ssize_t start, length
    if _take(c, 125):
        return metadata
    while True:
        length = _plain_string(c, &start)
        if length < 0 or not _take(c, 58):
            return None
        key = _utf8(c, start, length)
        length = _plain_string(c, &start)
        if length < 0 or key is None or key in metadata:
            return None
        value = _utf8(c, start, length)
        if value is None:
            return None
        metadata[key] = value
        if _take(c, 44):
            continue
        if _take(c, 125):
            return metadata
        return None


cdef bint _scan_header(_Header h, const uint8_t* p, Py_ssize_t n) except -1:
    """Parse and validate a header of the usual shape; False hands it to the strict parser."""
    cdef Cursor c
    c.p, c.pos, c.n = p, 0, n
    cdef Py_ssize_t start, length
    cdef Entry* entry
    cdef list names = h.names
    if not _take(&c, 123):
        return False
    if not _take(&c, 125):
        while True:
            length = _plain_string(&c, &start)
            if length < 0 or not _take(&c, 58) or not _take(&c, 123):
                return False
            if _is(&c, start, length, "__metadata__", 12):
                if h.metadata is not None:
                    return False
                h.metadata = _scan_metadata(&c)
                if h.metadata is None:
                    return False
            else:
                name = _utf8(&c, start, length)
                if name is None:
                    return False
                entry = h.add_entry()
                if not _scan_entry(h, &c, entry) or not _entry_is_valid(h, entry):
                    return False
                names.append(name)
            if _take(&c, 44):
                continue
            if _take(&c, 125):
                break
            return False
    _skip_space(&c)
    return c.pos == n and _names_are_unique(h)


cdef bint _names_are_unique(_Header h) except -1:
    """Sort the names (keys() needs them sorted; headers usually list them in order,
    which the sort finds in one pass), then look for equal neighbours."""
    cdef list ordered = sorted(h.names)
    cdef Py_ssize_t k
    for k in range(1, len(ordered)):
        if ordered[k] == ordered[k - 1]:
            return False
    h._sorted_names = ordered
    return True


# ---------------------------------------------------------------------------
# The strict parser: orjson (or its equal), then every rule checked with a precise message
# ---------------------------------------------------------------------------

cdef Py_ssize_t _count_members(const uint8_t* p, Py_ssize_t n, bint* has_minus) noexcept nogil:
    """Count the object members (colons outside strings) of a JSON text that is
    already known to be valid, and note whether a minus sign appears outside strings."""
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t colons = 0
    cdef bint in_string = False
    cdef uint8_t c
    while i < n:
        c = p[i]
        if in_string:
            if c == 92:        # backslash: skip the escaped character
                i += 1
            elif c == 34:      # closing quote
                in_string = False
        elif c == 34:
            in_string = True
        elif c == 58:          # ':'
            colons += 1
        elif c == 45:          # '-'
            has_minus[0] = True
        i += 1
    return colons


class _Pairs(list):
    """A JSON object kept as its list of (key, value) pairs, duplicates included."""


_NEGATIVE_ZERO = object()


def _parse_int_marking_negative_zero(str text):
    return _NEGATIVE_ZERO if text == "-0" else int(text)


def _pairs_of(bytes header):
    import json
    try:
        return json.loads(header, object_pairs_hook=_Pairs,
                          parse_int=_parse_int_marking_negative_zero)
    except (ValueError, RecursionError):
        return None


cdef str _describe_duplicate(bytes header):
    """Name the duplicated key (only runs on a header known to be bad). Linear in the
    header's size: one parse, one set per object."""
    pairs = _pairs_of(header)
    if pairs is None:
        return "header has a duplicate key"
    key = _first_repeated(pairs)
    if key is not None:
        what = "__metadata__ key" if key == "__metadata__" else "tensor name"
        return f"duplicate {what} {_shown(key)} (a reader could pick either value)"
    for name, info in pairs:
        if isinstance(info, _Pairs):
            key = _first_repeated(info)
            if key is not None:
                where = "__metadata__" if name == "__metadata__" else f"tensor {_shown(name)}"
                return f"{where}: duplicate key {_shown(key)}"
    return "header has a duplicate key"


cdef object _first_repeated(object pairs):
    """The first key of (key, value) pairs that an earlier pair already used, or None."""
    cdef set seen = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return None


cdef str _describe_negative_zero(bytes header):
    pairs = _pairs_of(header)
    if pairs is not None:
        for name, info in pairs:
            if isinstance(info, _Pairs):
                for field, value in info:
                    if isinstance(value, list) and any(v is _NEGATIVE_ZERO for v in value):
                        return f"tensor {_shown(name)}: {field} holds -0, not an unsigned integer"
    return "header holds -0 where an unsigned integer belongs"


cdef str _type_name(object value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


cdef inline bint _is_u64(object value):
    # bool is an int subclass; JSON true/false must not pass as 1/0
    return type(value) is int and value >= 0


cdef object _check_metadata(str source, object metadata):
    if type(metadata) is not dict:
        _fail(source, f"__metadata__ must be an object mapping strings to strings, "
                      f"got {_type_name(metadata)}")
    for key, value in (<dict>metadata).items():
        if type(value) is not str:
            _fail(source, f"__metadata__[{_shown(key)}] must be a string, got {_type_name(value)}")
    return metadata


cdef _check_fields(str source, object name, object info):
    if type(info) is not dict:
        _fail(source, f"tensor {_shown(name)}: entry must be an object with dtype, shape and "
                      f"data_offsets, got {_type_name(info)}")
    if len(<dict>info) != 3 or "dtype" not in info or "shape" not in info \
            or "data_offsets" not in info:
        missing = [f for f in ("dtype", "shape", "data_offsets") if f not in info]
        extra = [f for f in info if f not in ("dtype", "shape", "data_offsets")]
        problem = (f"missing field {_shown(missing[0])}" if missing
                   else f"unexpected field {_shown(extra[0])}")
        _fail(source, f"tensor {_shown(name)}: {problem} (entries hold exactly dtype, shape "
                      f"and data_offsets)")


cdef int _dtype_code(str source, object name, object dtype) except -1:
    if type(dtype) is not str:
        _fail(source, f"tensor {_shown(name)}: dtype must be a string, got {_type_name(dtype)}")
    code = _CODE_OF_NAME.get(dtype)
    if code is None:
        _fail(source, f"tensor {_shown(name)}: unknown dtype {_shown(dtype)} "
                      f"(known: {', '.join(DTYPE_CODES)})")
    return code


cdef _read_shape(_Header h, str source, object name, object shape, Entry* entry):
    if type(shape) is not list:
        _fail(source, f"tensor {_shown(name)}: shape must be an array of unsigned integers, "
                      f"got {_type_name(shape)}")
    entry.dims_at = h.dims_size
    for value in <list>shape:
        if not _is_u64(value):
            _fail(source, f"tensor {_shown(name)}: shape must hold unsigned integers, "
                          f"got {_type_name(value) if type(value) is not int else value}")
        h.add_dim(value)
    entry.ndim = len(<list>shape)


cdef _read_offsets(str source, object name, object offsets, Entry* entry):
    if type(offsets) is not list or len(<list>offsets) != 2:
        _fail(source, f"tensor {_shown(name)}: data_offsets must be an array [begin, end], "
                      f"got {_shown(offsets)}")
    begin, end = offsets
    if not _is_u64(begin) or not _is_u64(end):
        _fail(source, f"tensor {_shown(name)}: data_offsets must hold unsigned integers, got {_shown(offsets)}")
    entry.begin = begin
    entry.end = end
    if entry.begin > entry.end:
        _fail(source, f"tensor {_shown(name)}: data_offsets begin {begin} is past end {end}")


cdef _check_size(_Header h, str source, object name, Entry* entry):
    cdef bint overflow
    cdef uint64_t count = _element_count(h, entry, &overflow)
    cdef uint64_t nbytes = 0
    shape = h.shape(entry - h.entries)
    code = DTYPE_CODES[entry.code]
    if overflow:
        _fail(source, f"tensor {_shown(name)}: element count of shape {_shown(shape)} overflows 64 bits")
    cdef int status = fastst_packed_bytes(count, BITS[entry.code], &nbytes)
    if status > 0:
        _fail(source, f"tensor {_shown(name)}: byte size of shape {_shown(shape)} x {code} overflows 64 bits")
    if status < 0:
        _fail(source, f"tensor {_shown(name)}: {count} elements of {code} ({BITS[entry.code]} bits "
                      f"each) do not fill whole bytes")
    if entry.end - entry.begin != nbytes:
        _fail(source, f"tensor {_shown(name)}: data_offsets [{entry.begin}, {entry.end}] hold "
                      f"{entry.end - entry.begin} bytes but shape {_shown(shape)} x {code} needs {nbytes}")


cdef object _decode_json(str source, bytes header):
    from fastst._json import JSONDecodeError, loads   # only what the fast scanner passes on
    try:
        return loads(header)
    except JSONDecodeError as error:
        try:
            header.decode("utf-8")
        except UnicodeDecodeError as bad:
            _fail(source, f"header is not valid UTF-8 (byte {bad.start})")
        _fail(source, f"header is not valid JSON: {error}")


cdef _parse_strict(_Header h, bytes header):
    cdef str source = h.source
    obj = _decode_json(source, header)
    if type(obj) is not dict:
        _fail(source, f"header must be a JSON object, got {_type_name(obj)}")
    cdef dict top = <dict>obj
    cdef bint has_minus = False
    cdef Py_ssize_t members = _count_members(
        <const uint8_t*>PyBytes_AS_STRING(header), len(header), &has_minus)
    cdef Py_ssize_t seen = len(top)
    if "__metadata__" in top:
        h.metadata = _check_metadata(source, top["__metadata__"])
        seen += len(<dict>h.metadata)
    cdef Entry* entry
    for name, info in top.items():
        if name == "__metadata__":
            continue
        _check_fields(source, name, info)
        seen += 3
        entry = h.add_entry()
        entry.code = _dtype_code(source, name, info["dtype"])
        _read_shape(h, source, name, info["shape"], entry)
        _read_offsets(source, name, info["data_offsets"], entry)
        _check_size(h, source, name, entry)
        h.names.append(name)
    if seen != members:
        _fail(source, _describe_duplicate(header))
    if has_minus:
        _fail(source, _describe_negative_zero(header))


# ---------------------------------------------------------------------------
# Rules over the whole buffer, and the NumPy view of each shape
# ---------------------------------------------------------------------------

cdef _check_within(_Header h, Py_ssize_t header_length):
    """Every tensor must end within the buffer. One that does not means the file was
    cut short (or its header lies): the message gives the size the header describes
    and the size held, as whole files, and the first tensor cut off."""
    cdef Py_ssize_t i, first = -1
    cdef uint64_t data_end = 0
    cdef Entry* e = h.entries
    for i in range(h.n):
        data_end = max(data_end, e[i].end)
        if e[i].end > h.data_len and (first < 0 or (e[i].begin, e[i].end)
                                      < (e[first].begin, e[first].end)):
            first = i
    if first >= 0:
        start = 8 + <object>header_length     # a Python int: an end near 2**64 must not wrap
        _fail(h.source, f"the file is truncated: its header describes {start + data_end} "
                        f"bytes, the file holds {start + h.data_len} (tensor "
                        f"{_shown(h.names[first])}, at data_offsets [{e[first].begin}, "
                        f"{e[first].end}], is the first cut off)")


cdef _check_coverage(_Header h):
    """Offsets must tile the buffer exactly: sorted by (begin, end), each begins where
    the previous ended, the first at 0, the last at the buffer's end."""
    cdef Py_ssize_t n = h.n, i
    cdef Entry* e = h.entries
    for i in range(1, n):
        if e[i].begin < e[i - 1].begin or (e[i].begin == e[i - 1].begin and e[i].end < e[i - 1].end):
            _sort_by_offsets(h)
            e = h.entries
            break
    cdef list names = h.names
    cdef str source = h.source
    cdef uint64_t expected = 0
    for i in range(n):
        if e[i].begin > expected:
            _fail(source, f"tensor {_shown(names[i])}: data_offsets begin {e[i].begin} leaves a gap "
                          f"of {e[i].begin - expected} bytes after the previous tensor")
        if e[i].begin < expected:
            _fail(source, f"tensor {_shown(names[i])}: data_offsets [{e[i].begin}, {e[i].end}] overlap "
                          f"tensor {_shown(names[i - 1])}")
        expected = e[i].end
    if expected < h.data_len:     # never more: _check_within came first
        _fail(source, f"{h.data_len - expected} trailing bytes after the last tensor: "
                      f"the tensors cover {expected} of the buffer's {h.data_len} bytes")


cdef _sort_by_offsets(_Header h):
    cdef Py_ssize_t n = h.n, i
    keyed = sorted([(h.entries[i].begin, h.entries[i].end, i) for i in range(n)])
    cdef Entry* entries = <Entry*>malloc((n if n else 1) * sizeof(Entry))
    if entries == NULL:
        raise MemoryError()
    for i in range(n):
        entries[i] = h.entries[<Py_ssize_t>keyed[i][2]]
    free(h.entries)
    h.entries = entries
    h.capacity = n
    names = h.names
    h.names = [names[item[2]] for item in keyed]


cdef _set_numpy_dims(_Header h):
    """The dims each NumPy view will have. Sub-byte dtypes surface as packed uint8:
    the last axis holds the bytes when it packs evenly, else one flat axis."""
    cdef Py_ssize_t i, k
    cdef Entry* entry
    cdef uint64_t last_bytes
    for i in range(h.n):
        entry = &h.entries[i]
        entry.np_dims_at = entry.dims_at
        entry.np_ndim = entry.ndim if entry.ndim <= MAX_DIMS else -1
        for k in range(entry.ndim):
            if h.dims[entry.dims_at + k] > INTP_MAX:
                entry.np_ndim = -1
        if entry.np_ndim > 0 and BITS[entry.code] < 8:
            entry.np_dims_at = h.dims_size
            if fastst_packed_bytes(h.dims[entry.dims_at + entry.ndim - 1], BITS[entry.code],
                                   &last_bytes) == 0:
                for k in range(entry.ndim - 1):
                    h.add_dim(h.dims[entry.dims_at + k])
                h.add_dim(last_bytes)
            else:
                h.add_dim(entry.end - entry.begin)
                entry.np_ndim = 1
        if entry.np_ndim >= 0 and not _numpy_can_hold(h, entry):
            entry.np_ndim = -1


cdef bint _numpy_can_hold(_Header h, Entry* entry) noexcept:
    """NumPy's own rule: the product of the nonzero dims times the item size must
    fit in a signed 64-bit size, even when another dim makes the array empty."""
    cdef uint64_t size = BITS[entry.code] // 8 if BITS[entry.code] >= 8 else 1
    cdef uint64_t dim
    cdef Py_ssize_t k
    for k in range(entry.np_ndim):
        dim = h.dims[entry.np_dims_at + k]
        if dim and fastst_mul_overflow(size, dim, &size):
            return False
    return size <= INTP_MAX


cpdef _Header parse_header(bytes header, str source, uint64_t data_len):
    """Decode and validate a header against a buffer of `data_len` bytes."""
    cdef _Header h = _new_header(source, data_len)
    if not _scan_header(h, <const uint8_t*>PyBytes_AS_STRING(header), len(header)):
        h = _new_header(source, data_len)
        _parse_strict(h, header)
    _check_within(h, len(header))
    _check_coverage(h)
    _set_numpy_dims(h)
    return h


def _parse_header_strictly(bytes header, str source, uint64_t data_len):
    """The strict parser alone (for tests that compare the two)."""
    cdef _Header h = _new_header(source, data_len)
    _parse_strict(h, header)
    _check_within(h, len(header))
    _check_coverage(h)
    _set_numpy_dims(h)
    return h


cdef _Header _new_header(str source, uint64_t data_len):
    cdef _Header h = _Header.__new__(_Header)
    h.source = source
    h.data_len = data_len
    return h


def _describe(_Header h):
    """(names, dtype codes, shapes, offsets, metadata) of a parsed header (a test hook,
    like _parse_header_strictly)."""
    cdef Py_ssize_t i
    return (list(h.names), [DTYPE_CODES[h.entries[i].code] for i in range(h.n)],
            [h.shape(i) for i in range(h.n)],
            [(h.entries[i].begin, h.entries[i].end) for i in range(h.n)], h.metadata)


# ---------------------------------------------------------------------------
# The length prefix, and what a file whose prefix is no length is instead
# ---------------------------------------------------------------------------

cdef Py_ssize_t SNIFF_BYTES = 64   # first bytes looked at to tell what else a file is
_JSON_SPACE = b" \t\r\n"

# Leading bytes of files often opened by mistake. They are looked at only once the
# prefix is found wrong: a real prefix may begin with any of them (that of a header of
# 0x480 bytes begins b"\x80\x04", as a pickle does).
_MAGIC = (
    (b"\x93NUMPY", "a NumPy .npy file"),
    (b"PK\x03\x04", "a zip archive (.npz, .pt, wheel...)"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"GGUF", "a GGUF file"),
    (b"\x1f\x8b", "gzip-compressed (decompress it first)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed (decompress it first)"),
) + tuple((b"\x80" + bytes([protocol]), "a Python pickle") for protocol in range(2, 6))
_GIT_LFS = "version https://git-lfs.github.com/spec/"


def foreign_format(head):
    """What the first bytes of a file say it is, when its length prefix is no
    length (``"it is a NumPy .npy file"``, ``"it is text"``...): the rest of the
    message "not a safetensors file: ...", which every way of opening a file gives
    for one whose prefix is wrong; None when they do not tell."""
    head = bytes(head[:SNIFF_BYTES])
    text = _text_of(head)
    if text is not None:
        return _kind_of_text(text)
    if _header_begins(head):
        return None
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return f"it is {what}"
    return None


cdef bint _header_begins(bytes head):
    return head[8:].lstrip(_JSON_SPACE)[:1] == b"{"


cdef str _kind_of_text(str text):
    start = text.lstrip().lower()
    if start.startswith(("<!doctype html", "<html")):
        return "it is an HTML page (a web page or a folder listing, not the file itself)"
    if start.startswith(_GIT_LFS):
        return "it is a Git LFS pointer, not the file it stands for (git lfs pull fetches it)"
    if start[:1] in ("{", "["):
        return ("it is JSON text (a sharded checkpoint is opened by its directory or its "
                "*.index.json)")
    return "it is text"


cdef object _text_of(bytes head):
    """`head` as text, when it is printable UTF-8 (a UTF-8 byte order mark, and a
    character cut short at its end, aside) over its first 8 bytes at least, which a
    real length prefix never is: its high bytes are zero. None otherwise."""
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:]
    cdef Py_ssize_t decoded = len(head)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.reason != "unexpected end of data":
            return None
        decoded = error.start
        text = head[:decoded].decode("utf-8")
    if decoded < 8 or not all(c.isprintable() or c in "\t\n\r" for c in text):
        return None
    return text


cdef inline uint64_t _length_in(const uint8_t* prefix) noexcept:
    """The header length an 8-byte prefix gives (little-endian)."""
    cdef uint64_t n = 0
    cdef int k
    for k in range(8):
        n |= (<uint64_t>prefix[k]) << (8 * k)
    return n


cdef tuple _split_prefix(str source, const uint8_t* p, uint64_t available, uint64_t size,
                         uint64_t max_header):
    """Check the 8-byte length prefix; return (header length, data start). `p` holds
    the file's first `available` bytes: a wrong prefix is reported from them."""
    if size < 8:
        _fail(source, f"file is {size} bytes, shorter than the 8-byte header length")
    cdef uint64_t n = _length_in(p)
    if n > size - 8 or n > max_header:
        head = PyBytes_FromStringAndSize(<const char*>p, min(available, <uint64_t>SNIFF_BYTES))
        _fail(source, _wrong_prefix(head, n, size, max_header))
    return n, 8 + n


cdef str _wrong_prefix(bytes head, uint64_t n, uint64_t size, uint64_t max_header):
    """Why the length prefix `n` cannot be read. Raising the limit is offered only
    when a header could follow within the file: never for a file of another format,
    nor for a length past the file's end."""
    what = foreign_format(head)
    if what is not None:
        return f"not a safetensors file: {what}"
    header_may_follow = len(head) == 8 or _header_begins(head)
    if n > size - 8:
        if header_may_follow:
            return (f"the file is truncated: its header describes at least "
                    f"{8 + <object>n} bytes, the file holds {size}")
        return (f"not a safetensors file: its first 8 bytes give a header length of {n}, "
                f"past the end of the {size}-byte file")
    if header_may_follow:
        return (f"header length {n} exceeds the limit of {max_header} bytes "
                f"(raise max_header_size to read it)")
    return (f"not a safetensors file: its first 8 bytes give a header length of {n}, and "
            f"no JSON header follows them")
