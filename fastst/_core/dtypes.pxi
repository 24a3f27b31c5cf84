# THE dtype table, and every list derived from it (included by __init__.pyx).

# Rows are in the order of the reference's Dtype enum, which is also the order its
# writer sorts by (descending), so a row's index is its rank, and the code number
# every other table of the core is indexed by. Each row: (code, bits, NumPy dtype name,
# torch dtype name); the public DTYPES holds them as DtypeInfo (see records.pxi).
_DTYPE_ROWS = (
    ("BOOL", 8, "bool", "bool"),
    ("F4", 4, "uint8", "float4_e2m1fn_x2"),
    ("F6_E2M3", 6, "uint8", None),
    ("F6_E3M2", 6, "uint8", None),
    ("U8", 8, "uint8", "uint8"),
    ("I8", 8, "int8", "int8"),
    ("F8_E5M2", 8, "float8_e5m2", "float8_e5m2"),
    ("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn"),
    ("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz"),
    ("I16", 16, "int16", "int16"),
    ("U16", 16, "uint16", "uint16"),
    ("F16", 16, "float16", "float16"),
    ("BF16", 16, "bfloat16", "bfloat16"),
    ("I32", 32, "int32", "int32"),
    ("U32", 32, "uint32", "uint32"),
    ("F32", 32, "float32", "float32"),
    ("C64", 64, "complex64", "complex64"),
    ("F64", 64, "float64", "float64"),
    ("I64", 64, "int64", "int64"),
    ("U64", 64, "uint64", "uint64"),
)

DTYPE_CODES = tuple([row[0] for row in _DTYPE_ROWS])
_CODE_OF_NAME = {code: rank for rank, code in enumerate(DTYPE_CODES)}

# C copies of the table for code that runs without the GIL (the fast scanner) or
# per element. Fixed room, filled below from _DTYPE_ROWS; an entry's code is a uint8_t.
cdef enum:
    MAX_CODES = 32
    MAX_CODE_LENGTH = 16
cdef int N_CODES = 0
cdef int[MAX_CODES] BITS
cdef char[MAX_CODES][MAX_CODE_LENGTH] CODE_TEXT
cdef Py_ssize_t[MAX_CODES] CODE_LENGTH


cdef _fill_code_tables():
    global N_CODES
    if len(_DTYPE_ROWS) > MAX_CODES:
        raise ImportError(f"fastst holds at most {MAX_CODES} dtypes, DTYPES has {len(_DTYPE_ROWS)}")
    for rank, (code, bits, _, _) in enumerate(_DTYPE_ROWS):
        text = code.encode("ascii")
        if len(text) >= MAX_CODE_LENGTH:
            raise ImportError(f"dtype code {code} is longer than {MAX_CODE_LENGTH - 1}")
        memcpy(CODE_TEXT[rank], <const char*>text, len(text))
        CODE_LENGTH[rank] = len(text)
        BITS[rank] = bits
    N_CODES = len(_DTYPE_ROWS)


_fill_code_tables()


cdef inline int _code_of(const char* text, Py_ssize_t length) noexcept nogil:
    """The code of the dtype spelled `text`, or -1. Searched from the wide dtypes,
    the common ones, down."""
    cdef int code
    for code in range(N_CODES - 1, -1, -1):
        if (CODE_LENGTH[code] == length and text[0] == CODE_TEXT[code][0]
                and memcmp(CODE_TEXT[code], text, length) == 0):
            return code
    return -1


cdef object _little_endian(str name):
    # Spelled "<f4" rather than made with newbyteorder, NumPy hands back its own
    # shared dtype object, which arrays are faster to make from.
    return np.dtype("<" + np.dtype(name).str[1:])


# The dtypes NumPy lacks (bfloat16, float8) come from ml_dtypes, whose import takes
# over a second: it is paid only where such arrays are handed out as NumPy's. Their
# rows stay None until then; a NumPy-facing reader fills them when it opens a file
# that holds one (so that reads never import while they run), a writer when it meets
# one. A reader that leaves them out hands out their bits: the unsigned integer of
# their width.
cdef bint[MAX_CODES] FROM_ML_DTYPES
cdef bint ML_DTYPES_LOADED = False
cdef list _NUMPY_DTYPES = []      # code -> the NumPy dtype its tensors surface as
cdef list _BITS_DTYPES = []       # code -> the same, or its bits where ml_dtypes has it


cdef _fill_numpy_tables():
    for code, (_, bits, numpy_name, _) in enumerate(_DTYPE_ROWS):
        FROM_ML_DTYPES[code] = not hasattr(np, numpy_name)
        native = None if FROM_ML_DTYPES[code] else _little_endian(numpy_name)
        _NUMPY_DTYPES.append(native)
        _BITS_DTYPES.append(native if native is not None else _little_endian(f"uint{bits}"))


_fill_numpy_tables()
# NumPy dtype name -> code, for writing. Sub-byte codes have no NumPy dtype of their
# own (they surface as packed uint8), so they cannot be written from NumPy.
cdef dict _CODE_OF_NUMPY_NAME = {
    numpy_name: code for code, (_, bits, numpy_name, _) in enumerate(_DTYPE_ROWS) if bits >= 8}


cdef str _numpy_name(int code):
    """The name of the NumPy dtype (ml_dtypes' for the ones NumPy lacks) of code's tensors."""
    return _DTYPE_ROWS[code][2]


cdef object _numpy_dtype_of(int code):
    """The NumPy dtype of code's tensors, importing ml_dtypes for the rows it has."""
    dtype = _NUMPY_DTYPES[code]
    if dtype is None:
        _load_ml_dtypes()
        dtype = _NUMPY_DTYPES[code]
    return dtype


cdef _load_ml_dtypes():
    global ML_DTYPES_LOADED
    import ml_dtypes
    for code, (_, _, numpy_name, _) in enumerate(_DTYPE_ROWS):
        if FROM_ML_DTYPES[code]:
            _NUMPY_DTYPES[code] = np.dtype(getattr(ml_dtypes, numpy_name))
    ML_DTYPES_LOADED = True


cdef int _code_of_name(str code) except -1:
    """The code number of header dtype `code`."""
    try:
        return _CODE_OF_NAME[code]
    except KeyError:
        raise SafetensorError(f"unknown dtype {_shown(code)}") from None


def numpy_dtype(str code):
    """The NumPy dtype that tensors of header dtype `code` load as."""
    return _numpy_dtype_of(_code_of_name(code))


def dtype_bits(str code):
    """Bits per element of header dtype `code`."""
    return BITS[_code_of_name(code)]
