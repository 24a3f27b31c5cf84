# The error family, the one function that raises a format error, and the one way a
# value from a file is shown in a message (included by __init__.pyx).

class SafetensorError(ValueError):
    """A file, a buffer, a tensor or an argument breaks a rule of the format."""


class TensorNotFoundError(SafetensorError, KeyError):
    """The file holds no tensor of that name."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class SafetensorIndexError(SafetensorError, IndexError):
    """An index or a row reaches outside a tensor."""


class SafetensorTypeError(SafetensorError, TypeError):
    """A value of a type, or a dtype, that safetensors cannot store."""


class SafetensorNotImplementedError(SafetensorError, NotImplementedError):
    """Something the format, or fastst, cannot do."""


class NoSuchFileError(FileNotFoundError):
    """A file to open that does not exist."""

    def __str__(self):
        if self.filename is None or self.strerror is None:
            return super().__str__()
        return f"{self.strerror}: {os.fsdecode(self.filename)}"



cdef inline _fail(str source, str message):
    raise SafetensorError(f"{source}: {message}")


cdef enum:
    SHOWN_CHARS = 80     # longest rendering of a value in a message
    SHOWN_DEPTH = 3      # nesting rendered before "[...]" / "{...}"


cdef str _shown(object value):
    """`value` (a name, or anything a JSON header can hold) as at most SHOWN_CHARS
    characters, in time and stack depth bounded whatever its size and nesting."""
    # Items past a budget of 3/4 of the room become "...", so that brackets close.
    cdef str text = _render(value, SHOWN_DEPTH, SHOWN_CHARS * 3 // 4)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


cdef str _render(object value, int depth, Py_ssize_t budget):
    if isinstance(value, str):
        return repr((<str>value)[:budget])
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        # repr of a huge int is slow, and refused past 4300 digits
        return repr(value) if value.bit_length() <= 256 else f"<{value.bit_length()}-bit integer>"
    if isinstance(value, list):
        if depth == 0:
            return "[...]"
        return "[" + _render_items(value, depth, budget, False) + "]"
    if isinstance(value, tuple):
        if depth == 0:
            return "(...)"
        closing = ",)" if len(value) == 1 else ")"
        return "(" + _render_items(value, depth, budget, False) + closing
    if isinstance(value, dict):
        if depth == 0:
            return "{...}"
        return "{" + _render_items(value.items(), depth, budget, True) + "}"
    if isinstance(value, np.generic):
        return repr(value)     # NumPy scalars: short
    return f"<{type(value).__name__}>"


cdef str _render_items(object items, int depth, Py_ssize_t budget, bint pairs):
    """Items rendered and joined until `budget` characters are spent."""
    cdef list parts = []
    cdef Py_ssize_t used = 0
    for item in items:
        if used > budget:
            parts.append("...")
            break
        if pairs:
            part = _render(item[0], depth - 1, budget - used) + ": " + \
                _render(item[1], depth - 1, budget - used)
        else:
            part = _render(item, depth - 1, budget - used)
        parts.append(part)
        used += len(part) + 2
    return ", ".join(parts)
