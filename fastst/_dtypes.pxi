# THE dtype table, and every list derived from it (included by _core.pyx).

DtypeInfo = namedtuple("DtypeInfo", ["code", "bits", "numpy", "torch"], module="fastst")
DtypeInfo.__doc__ = """One safetensors dtype: header code, bits per element, the name of
the NumPy dtype its tensors surface as (packed uint8 for sub-byte codes), and the
name of the torch dtype (None where torch has none)."""

# Rows are in the order of the reference's Dtype enum, which is also the order its
# writer sorts by (descending), so a row's index is its rank, and the code number
# every other table of the core is indexed by.
DTYPES = (
    DtypeInfo("BOOL", 8, "bool", "bool"),
    DtypeInfo("F4", 4, "uint8", "float4_e2m1fn_x2"),
    DtypeInfo("F6_E2M3", 6, "uint8", None),
    DtypeInfo("F6_E3M2", 6, "uint8", None),
    DtypeInfo("U8", 8, "uint8", "uint8"),
    DtypeInfo("I8", 8, "int8", "int8"),
    DtypeInfo("F8_E5M2", 8, "float8_e5m2", "float8_e5m2"),
    DtypeInfo("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn"),
    DtypeInfo("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu"),
    DtypeInfo("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz"),
    DtypeInfo("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz"),
    DtypeInfo("I16", 16, "int16", "int16"),
    DtypeInfo("U16", 16, "uint16", "uint16"),
    DtypeInfo("F16", 16, "float16", "float16"),
    DtypeInfo("BF16", 16, "bfloat16", "bfloat16"),
    DtypeInfo("I32", 32, "int32", "int32"),
    DtypeInfo("U32", 32, "uint32", "uint32"),
    DtypeInfo("F32", 32, "float32", "float32"),
    DtypeInfo("C64", 64, "complex64", "complex64"),
    DtypeInfo("F64", 64, "float64", "float64"),
    DtypeInfo("I64", 64, "int64", "int64"),
    DtypeInfo("U64", 64, "uint64", "uint64"),
)

DTYPE_CODES = tuple([row.code for row in DTYPES])
_CODE_OF_NAME = {row.code: rank for rank, row in enumerate(DTYPES)}

# C copies of the table for code that runs without the GIL (the fast scanner) or
# per element. Fixed room, filled below from DTYPES; an entry's code is a uint8_t.
cdef enum:
    MAX_CODES = 32
    MAX_CODE_LENGTH = 16
cdef int N_CODES = 0
cdef int[MAX_CODES] BITS
cdef char[MAX_CODES][MAX_CODE_LENGTH] CODE_TEXT
cdef Py_ssize_t[MAX_CODES] CODE_LENGTH


cdef _fill_code_tables():
    global N_CODES
    if len(DTYPES) > MAX_CODES:
        raise ImportError(f"fastst holds at most {MAX_CODES} dtypes, DTYPES has {len(DTYPES)}")
    for rank, row in enumerate(DTYPES):
        text = row.code.encode("ascii")
        if len(text) >= MAX_CODE_LENGTH:
            raise ImportError(f"dtype code {row.code} is longer than {MAX_CODE_LENGTH - 1}")
        memcpy(CODE_TEXT[rank], <const char*>text, len(text))
        CODE_LENGTH[rank] = len(text)
        BITS[rank] = row.bits
    N_CODES = len(DTYPES)


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


# Filled on first open or write, so that `import fastst` does not pay for importing
# ml_dtypes (and reads never import while they run).
cdef tuple _NUMPY_DTYPES = None      # code -> the NumPy dtype its tensors surface as
cdef dict _CODE_OF_NUMPY_NAME = None  # NumPy dtype name -> code, for writing


cdef inline tuple _numpy_dtypes():
    if _NUMPY_DTYPES is None:
        _load_dtype_tables()
    return _NUMPY_DTYPES


cdef _load_dtype_tables():
    global _NUMPY_DTYPES, _CODE_OF_NUMPY_NAME
    import ml_dtypes
    dtypes = tuple([_numpy_dtype_named(ml_dtypes, row.numpy) for row in DTYPES])
    # Sub-byte codes have no NumPy dtype of their own (they surface as packed uint8),
    # so they cannot be written from NumPy.
    _CODE_OF_NUMPY_NAME = {
        dt.name: code for code, dt in enumerate(dtypes) if BITS[code] >= 8}
    _NUMPY_DTYPES = dtypes


cdef object _numpy_dtype_named(object ml_dtypes, str name):
    extension = getattr(ml_dtypes, name, None)
    if extension is not None:
        return np.dtype(extension)
    # The format is little-endian. Spelled "<f4" rather than made with newbyteorder,
    # NumPy hands back its own shared dtype object, which arrays are faster to make from.
    return np.dtype("<" + np.dtype(name).str[1:])


def numpy_dtype(str code):
    """The NumPy dtype that tensors of header dtype `code` surface as."""
    try:
        return _numpy_dtypes()[_CODE_OF_NAME[code]]
    except KeyError:
        raise SafetensorError(f"unknown dtype {_shown(code)}") from None


def dtype_bits(str code):
    """Bits per element of header dtype `code`."""
    try:
        return BITS[_CODE_OF_NAME[code]]
    except KeyError:
        raise SafetensorError(f"unknown dtype {_shown(code)}") from None
