"""libFuzzer target for fastst's readers.

Each input is the bytes of a would-be safetensors file. The target reads it through
every entry point and checks that they agree:

* ``fastst.load(data)`` (and ``load(bytearray(data))``) either refuses it with a
  ``SafetensorError`` or returns its tensors;
* the same bytes, written to a scratch file, are opened with ``safe_open`` under both
  backends ("mmap" and "pread"): ``keys()``, ``offset_keys()``, ``metadata()`` and
  ``get_tensors()`` must succeed or refuse exactly as ``load`` did, with the same
  message, and every tensor must hold the same bytes as ``load``'s; so must the bytes
  opened as a file object (``io.BytesIO``), which are read by byte ranges;
* for the first few tensors, ``get_slice(name)[index]`` with indices derived from the
  input (ints, slices with steps, Ellipsis, None, small integer arrays, tuples of
  these) must equal ``get_tensor(name)[index]``, or raise ``IndexError`` where NumPy
  raises it for the whole tensor, and where an integer array's value falls outside
  its axis though the arrays select nothing (which NumPy lets pass). Sub-byte
  tensors (F4, F6) may refuse an index into their packed axes with
  ``SafetensorError``; an index that selects everything gives the whole packed array.

``SafetensorError`` (and ``IndexError`` from indexing, under the rules above) are the
only exceptions expected. Any other exception, a disagreement between entry points
(raised as ``AssertionError``), a crash, a hang or a memory blow-up is a finding.

Half of the mutations rewrite the header as a header (``mutate_structure``), so that
many inputs are valid files with unusual dtypes, shapes and layouts. Run it with
``python fuzz/fuzz_load.py fuzz/corpus -runs=1000000 -max_len=4096`` (see
``fuzz/README.md``). Without atheris the module still imports, so tests can call
``TestOneInput`` directly.
"""
from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import sys
import tempfile
import warnings
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

# Imported before the instrumented import below, so that only fastst's own Python
# code carries coverage instrumentation (NumPy's would only slow every run down).
import ml_dtypes  # noqa: F401
import numpy as np

try:
    import atheris
except ImportError:  # the target can still be driven by hand, without coverage
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["fastst"]):
        import fastst
else:
    import fastst

from fastst import SafetensorError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from helpers import raw_file  # noqa: E402  (the tests' raw-file builder)

sys.path.pop(0)

BACKENDS = ("mmap", "pread")
SUB_BYTE_DTYPES = frozenset(row.code for row in fastst.DTYPES if row.bits < 8)
MAX_SLICED_TENSORS = 4      # tensors per input whose slices are checked
INDICES_PER_TENSOR = 4      # indices tried on each of them
MAX_SIGNALLED_TENSORS = 8   # tensors per input that feed the outcome signal
MAX_GATHERED = 1 << 20      # elements an integer-array index may gather

# The findings kept in fuzz/findings/, by the start of their files' names. While one
# is open, a long run can skip the slices that reach it and go on looking for others:
# FASTST_FUZZ_KNOWN=pread-unrepresentable,pread-narrow-index-array (see _known_finding
# and fuzz/README.md). By default every check applies.
FINDINGS = ("pread-narrow-index-array", "pread-packed", "pread-unrepresentable")
KNOWN_FINDINGS = frozenset(
    name for name in os.environ.get("FASTST_FUZZ_KNOWN", "").split(",") if name)
if not KNOWN_FINDINGS <= set(FINDINGS):
    raise SystemExit(f"FASTST_FUZZ_KNOWN: unknown findings {sorted(KNOWN_FINDINGS - set(FINDINGS))}; "
                     f"known: {', '.join(FINDINGS)}")


# ---------------------------------------------------------------------------
# Outcome signal. The compiled core carries no coverage instrumentation, so
# libFuzzer cannot see which of its checks an input reached. Each outcome (the kind
# of refusal, or the dtype and rank of a tensor read) is mapped to a slot, and the
# slot to one leaf of a generated, instrumented dispatch tree: reaching an outcome
# not seen before counts as new coverage, and the input that reached it is kept.
# ---------------------------------------------------------------------------

SIGNAL_SLOTS = 512
_slots: Dict[Any, int] = {}


def _dispatch_tree_source(slots: int) -> str:
    lines = ["def _reach(slot):"]

    def emit(low: int, high: int, depth: int) -> None:
        pad = "    " * depth
        if high - low == 1:
            lines.append(f"{pad}return {low}")
            return
        middle = (low + high) // 2
        lines.append(f"{pad}if slot < {middle}:")
        emit(low, middle, depth + 1)
        lines.append(f"{pad}else:")
        emit(middle, high, depth + 1)

    emit(0, slots, 1)
    return "\n".join(lines) + "\n"


def _build_reach() -> Callable[[int], int]:
    namespace: Dict[str, Any] = {}
    exec(compile(_dispatch_tree_source(SIGNAL_SLOTS), "<fastst-fuzz-signal>", "exec"),
         namespace)
    reach = namespace["_reach"]
    return atheris.instrument_func(reach) if atheris is not None else reach


_reach = _build_reach()

_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_LISTED = re.compile(r"\[[^\[\]]*\]")
_NUMBER = re.compile(r"\d+")


def _template(message: str) -> str:
    """A refusal message with its names, lists and numbers blanked out, so that all
    refusals of one kind share a template."""
    message = _QUOTED.sub("Q", message)
    previous = None
    while previous != message:
        previous, message = message, _LISTED.sub("L", message)
    return _NUMBER.sub("N", message)[:200]


def _signal(key: Any) -> None:
    slot = _slots.get(key)
    if slot is None:
        slot = len(_slots) if len(_slots) < SIGNAL_SLOTS else hash(key) % SIGNAL_SLOTS
        _slots[key] = slot
    _reach(slot)


# ---------------------------------------------------------------------------
# Scratch file: one path per process, rewritten for every input. Each input is
# written to a fresh inode that replaces the previous one, so that a mapping left
# over from an earlier input never sees its file shrink under it.
# ---------------------------------------------------------------------------

_SCRATCH_PREFIX = "fastst-fuzz-"


def _remove_stale_scratch(base: str) -> None:
    """libFuzzer ends the process without running atexit handlers: remove the
    scratch folders of processes that no longer exist."""
    for entry in os.listdir(base):
        pid = entry[len(_SCRATCH_PREFIX):].split("-", 1)[0]
        if entry.startswith(_SCRATCH_PREFIX) and pid.isdigit() \
                and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)


class _Scratch:
    def __init__(self) -> None:
        shm = "/dev/shm"
        base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
        if os.path.isdir("/proc/self"):
            _remove_stale_scratch(base)
        self.directory = tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-", dir=base)
        self.path = os.path.join(self.directory, "input.safetensors")
        self._next = self.path + ".next"

    def write(self, data: bytes) -> str:
        with open(self._next, "wb") as out:
            out.write(data)
        os.replace(self._next, self.path)
        return self.path

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


_scratch: Optional[_Scratch] = None


def _scratch_path(data: bytes) -> str:
    global _scratch
    if _scratch is None:
        _scratch = _Scratch()
        import atexit
        atexit.register(_scratch.remove)
    return _scratch.write(data)


# ---------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------

def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bit patterns (NaN-safe)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def _describe(array: np.ndarray) -> str:
    return f"{array.dtype}{list(array.shape)} {array.tobytes()[:64]!r}"


def _same_refusal(buffer_error: Optional[SafetensorError], file_error: SafetensorError,
                  path: str, backend: str) -> None:
    """A file is refused with the message its bytes got from load(), the buffer's
    name `<buffer>` replaced by the file's path."""
    assert buffer_error is not None, (
        f"{backend}: safe_open refused bytes that load() accepts: {file_error}")
    buffer_text, file_text = str(buffer_error), str(file_error)
    assert buffer_text.startswith("<buffer>: ") and file_text.startswith(path + ": "), (
        buffer_text, file_text)
    assert buffer_text[len("<buffer>"):] == file_text[len(path):], (
        f"{backend}: load() and safe_open refuse the same bytes differently:\n"
        f"  load:      {buffer_text}\n  safe_open: {file_text}")


# ---------------------------------------------------------------------------
# Indices
# ---------------------------------------------------------------------------

_INT_DTYPES = (np.int64, np.int32, np.int16, np.int8, np.intp,
               np.uint64, np.uint32, np.uint16, np.uint8)


def _position(rng: random.Random, n: int) -> int:
    """A position along an axis of extent n: in range, just out of it, or negative."""
    choice = rng.randrange(8)
    if choice == 0:
        return 0
    if choice == 1:
        return n - 1
    if choice == 2:
        return -1
    if choice == 3:
        return -n
    if choice == 4:
        return n
    if choice == 5:
        return -n - 1
    return rng.randint(-n - 1, n) if n < 2**70 else rng.randint(-8, 8)


def _fit(value: int, dtype: Any) -> int:
    info = np.iinfo(dtype)
    return min(max(value, int(info.min)), int(info.max))


def _index_part(rng: random.Random, n: int) -> Any:
    kind = rng.randrange(20)
    if kind < 6:
        return _position(rng, n)
    if kind < 12:
        start = rng.choice([None, None, _position(rng, n), _position(rng, n)])
        stop = rng.choice([None, None, _position(rng, n), _position(rng, n)])
        step = rng.choice([None, 1, 2, 3, -1, -2, -3, n + 1, -(n + 1)])
        return slice(start, stop, step or None)
    if kind < 15:
        dtype = rng.choice(_INT_DTYPES)
        count = rng.choice([0, 1, 1, 2, 3, 4])
        values = [_fit(_position(rng, n), dtype) for _ in range(count)]
        array = np.array(values, dtype=dtype)
        if count == 4 and rng.random() < 0.3:
            array = array.reshape(2, 2)
        return array
    if kind < 17:
        dtype = rng.choice(_INT_DTYPES)
        return dtype(_fit(_position(rng, n), dtype))
    if kind < 19:
        return Ellipsis
    return None


def _index(rng: random.Random, shape: Tuple[int, ...]) -> Any:
    """An index for an array of `shape`: one part, or a tuple of up to ndim + 1."""
    if rng.random() < 0.4:
        return _index_part(rng, shape[0] if shape else 1)
    parts: List[Any] = []
    for axis in range(rng.randint(0, min(len(shape), 6) + 1)):
        part = _index_part(rng, shape[axis] if axis < len(shape) else 1)
        if part is Ellipsis and any(p is Ellipsis for p in parts):
            part = slice(None)          # NumPy allows one Ellipsis per index
        if part is None and len(shape) + sum(p is None for p in parts) >= 63:
            part = slice(None)          # and at most 64 dims in the result
        parts.append(part)
    return tuple(parts)


def _slice_length(part: slice, n: int) -> int:
    """len(range(*part.indices(n))), for extents past what len() can return."""
    start, stop, step = part.indices(n)
    if step > 0:
        return max(0, (stop - start + step - 1) // step)
    return max(0, (start - stop - step - 1) // -step)


def _gathered_bound(shape: Tuple[int, ...], index: Any) -> int:
    """An upper bound on the elements NumPy allocates for `index` on an array of
    `shape` when the index holds integer arrays (it allocates the result before it
    checks the positions), 0 for basic indexing, which allocates nothing. Empty axes
    count as 1: NumPy refuses a result whose other axes overflow, empty or not."""
    parts = index if isinstance(index, tuple) else (index,)
    if not any(isinstance(part, np.ndarray) for part in parts):
        return 0
    consuming = sum(part is not None and part is not Ellipsis for part in parts)
    expanded: List[Any] = []
    for part in parts:
        if part is Ellipsis:
            expanded.extend([slice(None)] * max(len(shape) - consuming, 0))
        else:
            expanded.append(part)
    bound, axis = 1, 0
    for part in expanded:
        if part is None:
            continue
        n = shape[axis] if axis < len(shape) else 1
        if isinstance(part, slice):
            bound *= max(_slice_length(part, n), 1)
        elif isinstance(part, np.ndarray):
            bound *= max(part.size, 1)
        axis += 1
    for n in shape[axis:]:
        bound *= max(n, 1)
    return bound


def _known_finding(backend: str, code: str, logical: Tuple[int, ...],
                   whole: Optional[np.ndarray], index: Any) -> Optional[str]:
    """The name of the reported finding this slice would reach, if any."""
    if backend != "pread":
        return None
    if whole is None:
        return "pread-unrepresentable"
    if code in SUB_BYTE_DTYPES and (whole.ndim != len(logical)
                                    or whole.shape[:1] != logical[:1]):
        return "pread-packed"
    head = index[0] if isinstance(index, tuple) and index else index
    if (isinstance(head, np.ndarray) and head.dtype.kind in "iu" and head.size and logical
            and logical[0] > np.iinfo(head.dtype).max):
        return "pread-narrow-index-array"
    return None


def _selects_whole(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(part is Ellipsis or (isinstance(part, slice) and part == slice(None))
               for part in parts)


def _take(array: Optional[np.ndarray], whole_error: Optional[SafetensorError],
          index: Any) -> Tuple[Optional[np.ndarray], Optional[BaseException]]:
    """What indexing the whole tensor gives: an array, or the error."""
    if array is None:
        return None, whole_error
    try:
        with warnings.catch_warnings():
            # NumPy before 2.5 warns (rather than raising) for an integer array's value
            # outside its axis when nothing is selected; the check below refuses it.
            warnings.simplefilter("ignore", DeprecationWarning)
            taken = array[index]
    except IndexError as error:
        return None, error
    if _array_value_outside(index, array.shape):
        return None, IndexError("an integer array's value is outside its axis")
    return taken, None


def _array_value_outside(index: Any, shape: Tuple[int, ...]) -> bool:
    """Whether a value of an integer array of `index` falls outside its axis: NumPy
    lets that pass when the arrays broadcast to no element, fastst refuses it."""
    parts = [np.asarray(part) if isinstance(part, list) else part
             for part in (index if isinstance(index, tuple) else (index,))]
    widths = [0 if part is None or part is Ellipsis else
              part.ndim if isinstance(part, np.ndarray) and part.dtype == np.bool_ else 1
              for part in parts]
    axis = 0
    for place, part in enumerate(parts):
        if part is Ellipsis:
            axis = len(shape) - sum(widths[place + 1:])
            continue
        if isinstance(part, np.ndarray) and part.dtype.kind in "iu" and part.size:
            values = part.astype(object).reshape(-1)    # no wrapping, whatever the dtype
            if any(not -shape[axis] <= value < shape[axis] for value in values):
                return True
        axis += widths[place]
    return False


def _check_slices(reader: fastst.safe_open, backend: str, name: str,
                  rng: random.Random) -> None:
    handle = reader.get_slice(name)
    code = handle.get_dtype()
    logical = tuple(handle.get_shape())
    try:
        whole: Optional[np.ndarray] = reader.get_tensor(name)
        whole_error: Optional[SafetensorError] = None
    except SafetensorError as error:       # a shape NumPy cannot hold
        whole, whole_error = None, error
    shape = whole.shape if whole is not None else logical
    for _ in range(INDICES_PER_TENSOR):
        index = _index(rng, shape)
        if _gathered_bound(shape, index) > MAX_GATHERED:
            index = Ellipsis            # would allocate more than the check is worth
        if _known_finding(backend, code, logical, whole, index) in KNOWN_FINDINGS:
            try:
                handle[index]
            except Exception:
                pass
            continue
        if code in SUB_BYTE_DTYPES and whole is not None and _selects_whole(index):
            # A packed tensor has fewer array axes than its header names: an index
            # that selects everything along every named axis gives the whole array.
            expected, expected_error = whole, None
        else:
            expected, expected_error = _take(whole, whole_error, index)
        try:
            got = handle[index]
        except IndexError as error:   # SafetensorIndexError included
            assert isinstance(expected_error, IndexError), (
                f"{backend}: get_slice({name!r})[{index!r}] of {code}{list(logical)} "
                f"raised IndexError({error}) where get_tensor()[index] gives "
                f"{expected_error!r}" if expected is None else
                f"{backend}: get_slice({name!r})[{index!r}] of {code}{list(logical)} "
                f"raised IndexError({error}) where get_tensor()[index] gives "
                f"{_describe(expected)}")
            _signal(("index error", backend))
            continue
        except SafetensorError as error:
            if code in SUB_BYTE_DTYPES and "stored packed" in str(error):
                _signal(("packed refusal", backend))
                continue
            assert isinstance(expected_error, SafetensorError), (
                f"{backend}: get_slice({name!r})[{index!r}] of {code}{list(logical)} "
                f"raised SafetensorError({error}) where get_tensor()[index] gives "
                f"{expected_error!r}")
            continue
        assert expected is not None, (
            f"{backend}: get_slice({name!r})[{index!r}] of {code}{list(logical)} gave "
            f"{_describe(got)} where get_tensor()[index] raises {expected_error!r}")
        assert _same_array(got, expected), (
            f"{backend}: get_slice({name!r})[{index!r}] of {code}{list(logical)} gave "
            f"{_describe(got)}, get_tensor()[index] gives {_describe(expected)}")
        _signal(("slice", backend, got.ndim > 0, got.size > 0))


# ---------------------------------------------------------------------------
# The target
# ---------------------------------------------------------------------------

def _load(data: Any) -> Tuple[Optional[Dict[str, np.ndarray]], Optional[SafetensorError]]:
    try:
        return fastst.load(data), None
    except SafetensorError as error:
        return None, error


def _check_file(path: str, backend: str, loaded: Optional[Dict[str, np.ndarray]],
                load_error: Optional[SafetensorError], rng: random.Random) -> None:
    _check_opened(lambda: fastst.safe_open(path, framework="np", backend=backend), path,
                  backend, loaded, load_error, rng)


def _check_file_object(data: bytes, loaded: Optional[Dict[str, np.ndarray]],
                       load_error: Optional[SafetensorError], rng: random.Random) -> None:
    """The bytes as a file object: read by byte ranges (the remote backend)."""
    _check_opened(lambda: fastst.safe_open(io.BytesIO(data), framework="np"), "<BytesIO>",
                  "ranges", loaded, load_error, rng)


def _check_opened(open_it: Callable[[], Any], path: str, backend: str,
                  loaded: Optional[Dict[str, np.ndarray]],
                  load_error: Optional[SafetensorError], rng: random.Random) -> None:
    try:
        reader = open_it()
    except SafetensorError as error:
        _same_refusal(load_error, error, path, backend)
        return
    with reader:
        keys = reader.keys()
        offset_keys = reader.offset_keys()
        metadata = reader.metadata()
        assert keys == sorted(offset_keys), (keys, offset_keys)
        assert metadata is None or all(
            type(k) is str and type(v) is str for k, v in metadata.items()), metadata
        try:
            tensors = reader.get_tensors()
        except SafetensorError as error:   # a tensor NumPy cannot hold: load() refuses too
            _same_refusal(load_error, error, path, backend)
        else:
            assert loaded is not None, (
                f"{backend}: safe_open reads bytes that load() refuses: {load_error}")
            assert list(tensors) == offset_keys == list(loaded), (
                list(tensors), offset_keys, list(loaded))
            for name, array in tensors.items():
                assert _same_array(array, loaded[name]), (
                    f"{backend}: tensor {name!r} reads {_describe(array)} from the file "
                    f"but {_describe(loaded[name])} from load()")
        for name in offset_keys[:MAX_SLICED_TENSORS]:
            _check_slices(reader, backend, name, rng)


def TestOneInput(data: bytes) -> None:
    loaded, load_error = _load(data)
    if load_error is not None:
        _signal(("refused", _template(str(load_error))))
    else:
        assert loaded is not None
        for name in list(loaded)[:MAX_SIGNALLED_TENSORS]:
            array = loaded[name]
            _signal(("tensor", array.dtype.name, min(array.ndim, 4), array.size > 0))
        again, again_error = _load(bytearray(data))
        assert again is not None and list(again) == list(loaded), again_error
        for name, array in again.items():
            assert array.flags.writeable and _same_array(array, loaded[name]), name

    path = _scratch_path(data)
    rng = random.Random(zlib.crc32(data))   # indices derived from the input
    for backend in BACKENDS:
        _check_file(path, backend, loaded, load_error, rng)
    _check_file_object(data, loaded, load_error, rng)


# ---------------------------------------------------------------------------
# Structure-aware mutation. Byte-level mutations of a header almost always break
# its JSON or its offsets, so few mutated files ever reach the tensor views and the
# slicing code. Half of the mutations instead decode the header, change it as a
# header (a dtype, a dim, the number, names or buffer order of tensors, the
# metadata), lay the offsets out again so that they tile the data, and re-encode it.
# A few of them are left slightly broken on purpose.
# ---------------------------------------------------------------------------

STRUCTURED_SHARE = 0.5
DTYPE_CODES = tuple(fastst.DTYPE_CODES)
_BITS = {code: bits for code, bits in zip(DTYPE_CODES, (
    8, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64))}
INTERESTING_DIMS = (0, 0, 1, 1, 2, 3, 4, 5, 7, 8, 9, 16, 127, 128, 129, 255, 256, 257,
                    300, 32767, 32768, 65536, 2**31 - 1, 2**31, 2**32, 2**40, 2**62,
                    2**63 - 1, 2**63, 2**64 - 1)
INTERESTING_NAMES = ("", "a", "b", "__metadata", "-0", "a:b", '"', "\\", "\u00e9", "\x00",
                     "\U0001F600", "\u2028", "x" * 40)


def _split(data: bytes) -> Optional[Tuple[Dict[str, Any], bytes]]:
    if len(data) < 8:
        return None
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        return None
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError):
        return None
    return (header, data[8 + n:]) if isinstance(header, dict) else None


def _tensor_bytes(code: str, shape: List[int]) -> Optional[int]:
    count = 1
    for dim in shape:
        count *= dim
    bits = count * _BITS[code]
    return bits // 8 if bits % 8 == 0 else None


def mutate_structure(data: bytes, rng: random.Random, max_size: int) -> Optional[bytes]:
    """`data` with its header changed as a header, or None when it has no JSON object
    header to change."""
    split = _split(data)
    if split is None:
        return None
    header, payload = split
    metadata = header.pop("__metadata__", None)
    tensors: List[List[Any]] = []
    for name, info in header.items():
        if isinstance(info, dict):
            code = info.get("dtype")
            if not isinstance(code, str) or code not in _BITS:
                code = rng.choice(DTYPE_CODES)
            shape = info.get("shape")
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                shape = [rng.randint(0, 4)]
            tensors.append([name, code, shape[:70]])
    operation = rng.randrange(10) if tensors else 5
    if operation == 0:
        rng.choice(tensors)[1] = rng.choice(DTYPE_CODES)
    elif operation in (1, 2):
        shape = rng.choice(tensors)[2]
        if shape:
            shape[rng.randrange(len(shape))] = rng.choice(INTERESTING_DIMS)
        else:
            shape.append(rng.choice(INTERESTING_DIMS))
    elif operation == 3:
        shape = rng.choice(tensors)[2]
        if shape and rng.random() < 0.5:
            del shape[rng.randrange(len(shape))]
        else:
            count = rng.choice([1, 1, 2, 60, 63, 64, 65])
            shape.insert(rng.randint(0, len(shape)), rng.choice((0, 1, 1, 2, 3)))
            while count > 1 and len(shape) < count:
                shape.append(1)
    elif operation == 4:
        rng.choice(tensors)[2] = [rng.randint(0, 6) for _ in range(rng.randint(0, 4))]
    elif operation == 5:
        tensors.append([rng.choice(INTERESTING_NAMES) + str(rng.randrange(100)),
                        rng.choice(DTYPE_CODES),
                        [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]])
    elif operation == 6:
        del tensors[rng.randrange(len(tensors))]
    elif operation == 7:
        rng.choice(tensors)[0] = rng.choice(INTERESTING_NAMES)
    elif operation == 8:
        metadata = ({} if not isinstance(metadata, dict) else metadata)
        metadata[rng.choice(INTERESTING_NAMES)] = rng.choice(["", "v", "0", "-0", "{}"])
        if rng.random() < 0.1:
            metadata = rng.choice([None, [], 0, {"k": 1}])
    # operation 9: keep the tensors, lay them out again in a new buffer order

    budget = max(max_size - 8 - 200 - 90 * len(tensors), 0)
    sizes = []
    for tensor in tensors:
        _, code, shape = tensor
        if _tensor_bytes(code, shape) is None and rng.random() < 0.9:
            shape[-1:] = [(shape[-1] if shape else 1) * (8 // _BITS[code] if _BITS[code] == 4 else 4)]
        size = _tensor_bytes(code, shape)
        if size is not None and size > budget and shape:
            shape[rng.randrange(len(shape))] = 0
            size = 0
        sizes.append(size or 0)
        budget -= sizes[-1]
    order = list(range(len(tensors)))
    rng.shuffle(order)
    offsets: Dict[int, List[int]] = {}
    position = 0
    for k in order:
        offsets[k] = [position, position + sizes[k]]
        position += sizes[k]
    total = position
    if tensors and rng.random() < 0.05:               # an off-by-one on purpose
        broken = offsets[rng.choice(order)]
        broken[rng.randrange(2)] += rng.choice((-1, 1))
    if rng.random() < 0.03:
        total += rng.choice((-1, 1))

    entries: List[Tuple[str, Any]] = [
        (name, {"dtype": code, "shape": shape, "data_offsets": offsets[k]})
        for k, (name, code, shape) in enumerate(tensors)]
    if metadata is not None or rng.random() < 0.03:
        entries.insert(rng.randint(0, len(entries)), ("__metadata__", metadata))
    text = json.dumps(dict(entries), separators=rng.choice([(",", ":"), (", ", ": ")]),
                      ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    align = 8 if rng.random() < 0.9 else 1           # now and then an unpadded header
    payload = payload or bytes(rng.randrange(256) for _ in range(16))
    body = (payload * (total // len(payload) + 1))[:max(total, 0)]
    out = raw_file(text, body, align=align)
    return out if len(out) <= max_size else None


def _custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < STRUCTURED_SHARE:
        mutated = mutate_structure(data, rng, max_size)
        if mutated is not None:
            return mutated
    return atheris.Mutate(data, max_size)


def main() -> None:
    if atheris is None:
        sys.exit("fuzz_load.py needs atheris: pip install atheris")
    atheris.Setup(sys.argv, TestOneInput, custom_mutator=_custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
