# The core's named tuples (DtypeInfo, TensorInfo, ReadOptions, WriteSpec) and the
# public DTYPES, made on their first use (included by __init__.pyx): a named tuple
# type costs about 0.1 ms to make, together a third of the module's load, and a
# first read needs none of them. Made under a lock, so that every thread sees one
# class of each.

cdef dict _RECORD_FIELDS = {
    "DtypeInfo": ("fastst", ["code", "bits", "numpy", "torch"],
                  """One dtype of the format: a row of `DTYPES`."""),
    "TensorInfo": ("fastst", ["dtype", "shape", "data_offsets", "array_shape"],
                   """What a file's header says of one tensor, as ``info(name)`` gives
it."""),
    "ReadOptions": ("fastst", ["threads", "request_bytes", "direct", "hints", "huge_pages"],
                    """How local files are read into fresh memory (see `read_options`)."""),
    "WriteSpec": ("fastst.writer", ["name", "dtype", "shape", "data"],
                  """One tensor to write: its name, header dtype code, header shape,
and the array of its bytes."""),
}
LAZY_NAMES = frozenset(_RECORD_FIELDS) | {"DTYPES"}
cdef dict _RECORDS = {}
cdef object _MAKING_RECORDS = _thread.RLock()    # DTYPES makes DtypeInfo within


cdef object _record(str name):
    """The record type (or, for ``"DTYPES"``, the table) called `name`."""
    made = _RECORDS.get(name)
    if made is not None:
        return made
    with _MAKING_RECORDS:
        made = _RECORDS.get(name)
        if made is None:
            made = _RECORDS[name] = _make_record(name)
    return made


cdef object _make_record(str name):
    if name == "DTYPES":
        row_type = _record("DtypeInfo")
        return tuple([row_type(*row) for row in _DTYPE_ROWS])
    module, fields, doc = _RECORD_FIELDS[name]
    made = namedtuple(name, fields, module=module)
    made.__doc__ = doc
    return made
