"""A restricted reader of the pickle inside a ``torch.save`` checkpoint.

The pickle is run by a subclass of Python's pure-Python unpickler in which

* ``find_class`` knows a short list of names (containers, ``torch.Size``, dtypes,
  storage classes and the tensor rebuild functions) and hands back stand-ins
  written here, never the named object: nothing is imported, nothing of torch
  runs, and any other name is refused with a SafetensorError naming it;
* ``REDUCE`` calls only those stand-ins; ``BUILD`` is accepted only on the
  state dicts' ``OrderedDict``; the opcodes that build arbitrary objects
  (``INST``, ``OBJ``, ``NEWOBJ``, ``NEWOBJ_EX``, the copyreg ``EXT`` codes) and
  out-of-band buffers are refused;
* ``persistent_load`` turns a storage reference into a StorageRef, and each
  tensor becomes a TensorRef: a lazy `(storage, dtype, offset, shape, stride)`.

The pure-Python unpickler keeps its memo in a dict, so a pickle cannot make it
allocate by naming a huge memo index; the file object it reads refuses reads past
the end of the data.

The memo lets a few bytes refer to a large value again and again (or to a tuple
of tuples that, unfolded, is exponentially large), so no opcode may do work in
proportion to the values it is handed:

* a dict key or set item is hashed only when it is a str, bytes, bool, None, a
  float, an int below 2**61 in size (whose hashes do not collide on purpose) or
  an object hashed by identity: a tuple's hash walks all of it, and ints, tuples
  and complex numbers can be chosen to share one hash;
* every call of an allowed global is charged the length of its arguments
  against a budget of WORK_PER_BYTE units per byte of the pickle, so that no
  value can be copied or walked over and over;
* memo indices and the reprs in messages are bounded.
"""
from __future__ import annotations

import io
import itertools
import pickle
import struct
import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._core import DTYPES, SafetensorError, SafetensorTypeError
from .._format.torch_dtypes import CODE_OF_TORCH_NAME

__all__ = ["StorageRef", "TensorRef", "RestrictedUnpickler", "load_pickle", "UNTYPED",
           "MAX_DIMS", "WORK_PER_BYTE"]

UNTYPED = "untyped"     # the dtype of a torch.UntypedStorage: bytes, typed by the tensor
MAX_DIMS = 64
MAX_INDEX = 2**62       # larger offsets, dims and strides cannot address a real file
MAX_ARGS = 8            # _rebuild_tensor_v3 takes the most
MAX_MEMO_INDEX = 2**32  # BINPUT and LONG_BINPUT cannot name more
# An int key of this size or more shares its hash with a smaller one (the hash of
# an int is the int modulo 2**61 - 1), so a pickle could pile keys onto one slot.
MAX_KEY_INT = sys.hash_info.modulus
# Units of work (elements handed to a call) a pickle may spend per byte, on top of
# WORK_BASE: each value a pickle builds is handed to a call about once; a pickle
# that hands the same large value to calls over and over is refused.
WORK_PER_BYTE = 2
WORK_BASE = 1 << 20

BITS_OF_CODE: Dict[str, int] = {row.code: row.bits for row in DTYPES}
# Torch's legacy typed storage classes -> the torch dtype name they hold.
STORAGE_CLASSES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}
# Dtypes torch saves that the format has no code for: named in the refusal.
TORCH_DTYPE_NAMES = tuple(CODE_OF_TORCH_NAME) + (
    "complex128", "complex32", "qint8", "qint32", "quint8", "quint4x2", "quint2x4",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")


def torch_itemsize(code: str) -> int:
    """Bytes per torch element of header dtype `code` (float4 packs two in a byte)."""
    return max(BITS_OF_CODE[code] // 8, 1)


class _Refused(SafetensorError):
    """Raised from inside the unpickler; the reader adds the file's name."""


class StorageRef:
    """One storage of the checkpoint: its key in the archive, the header code of
    its dtype (UNTYPED for bytes) and its size in elements of that dtype."""
    __slots__ = ("key", "code", "numel")

    def __init__(self, key: str, code: str, numel: int) -> None:
        self.key, self.code, self.numel = key, code, numel

    @property
    def nbytes(self) -> int:
        return self.numel * (1 if self.code == UNTYPED else torch_itemsize(self.code))

    def __setstate__(self, state: Any) -> None:
        raise _Refused("BUILD on a storage")


class TensorRef:
    """A tensor of the checkpoint, not read yet: `shape` and `stride` count torch
    elements of dtype `code`, from element `offset` of `storage`."""
    __slots__ = ("storage", "code", "offset", "shape", "stride")

    def __init__(self, storage: StorageRef, code: str, offset: int,
                 shape: Tuple[int, ...], stride: Tuple[int, ...]) -> None:
        self.storage, self.code, self.offset = storage, code, offset
        self.shape, self.stride = shape, stride

    @property
    def itemsize(self) -> int:
        return torch_itemsize(self.code)

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def byte_span(self) -> Tuple[int, int]:
        """The bytes of the storage the tensor's elements lie in: [begin, end)."""
        begin = self.offset * self.itemsize
        if self.numel == 0:
            return begin, begin
        last = self.offset + sum((dim - 1) * step for dim, step in zip(self.shape, self.stride))
        return begin, (last + 1) * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for dim, step in zip(reversed(self.shape), reversed(self.stride)):
            if dim != 1 and step != expected:
                return False
            expected *= dim
        return True

    def header_shape(self) -> Tuple[int, ...]:
        """The shape in the safetensors header: float4's last dim counts values."""
        if self.code == "F4":
            if not self.shape:
                raise _Refused("a 0-d float4_e2m1fn_x2 tensor has no last dim for its two values")
            return self.shape[:-1] + (self.shape[-1] * 2,)
        return self.shape

    def layout(self) -> Tuple[Any, ...]:
        return (self.storage.key, self.code, self.offset, self.shape, self.stride)

    @property
    def dtype(self) -> str:
        return self.code

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise SafetensorError("a tensor of the checkpoint is read by its byte range, not "
                              "as an array")

    def __setstate__(self, state: Any) -> None:
        raise _Refused("BUILD on a tensor")


class StateDict(OrderedDict):  # type: ignore[type-arg]
    """The OrderedDict a state dict is pickled as: BUILD may set its `_metadata`
    (module versions), which is dropped."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise _Refused(f"BUILD on an OrderedDict with a {type(state).__name__} state")


class _StandIn:
    """What find_class hands back for an allowed global: a named marker, callable
    when `build` is given. It has no attributes to set and refuses BUILD."""
    __slots__ = ("name", "build", "value")

    def __init__(self, name: str, build: Optional[Callable[..., Any]] = None,
                 value: Any = None) -> None:
        self.name, self.build, self.value = name, build, value

    def __call__(self, *args: Any) -> Any:
        if self.build is None:
            raise _Refused(f"{self.name} cannot be called")
        return self.build(*args)

    def __setstate__(self, state: Any) -> None:
        raise _Refused(f"BUILD on {self.name}")

    def __repr__(self) -> str:
        return self.name


# ---------------------------------------------------------------------------
# The stand-ins' constructors: each checks its arguments and builds plain data.
# ---------------------------------------------------------------------------

def _index(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INDEX:
        raise _Refused(f"{what} must be an integer from 0 to 2**62, got {_short(value)}")
    return value


def _dims(value: Any, what: str) -> Tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > MAX_DIMS:
        raise _Refused(f"{what} must be a tuple of at most {MAX_DIMS} integers, got "
                       f"{_short(value)}")
    return tuple(_index(dim, what) for dim in value)


def _short(value: Any, limit: int = 60) -> str:
    """A repr of `value` for a message, cut at `limit` characters: the work is
    bounded by the limit, whatever the size of the value (a tuple of tuples that
    shares its items, a huge int or str)."""
    text = _bounded_repr(value, limit + 1)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Piece(str):
    """Text of a repr being written, told apart from a str value to write."""


def _bounded_repr(value: Any, limit: int) -> str:
    out: List[str] = []
    length = 0
    todo: List[Any] = [value]
    while todo and length < limit:
        item = todo.pop()
        if type(item) is _Piece:
            piece = str(item)
        elif type(item) is tuple and item:
            todo.append(_Piece(",)" if len(item) == 1 else ")"))
            items = list(itertools.islice(item, limit))     # each adds a character or more
            for position in range(len(items) - 1, -1, -1):
                todo.append(items[position])
                if position:
                    todo.append(_Piece(", "))
            piece = "("
        elif type(item) in (str, bytes):
            piece = repr(item[:limit])
        elif type(item) is int and item.bit_length() > 64:
            piece = f"<int of {item.bit_length()} bits>"
        elif type(item) in (int, bool, tuple, type(None)):     # a tuple here is empty
            piece = repr(item)
        else:
            piece = f"<{type(item).__name__}>"
        out.append(piece)
        length += len(piece)
    return "".join(out)


def _size(*args: Any) -> Tuple[int, ...]:
    if len(args) != 1:
        raise _Refused("torch.Size takes one tuple")
    value = args[0]
    return _dims(tuple(value) if isinstance(value, list) else value, "torch.Size")


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, code: str,
            requires_grad: Any, hooks: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise _Refused(f"a tensor's storage must be a storage reference, got {_short(storage)}")
    shape = _dims(size, "a tensor's size")
    steps = _dims(stride, "a tensor's stride")
    if len(steps) != len(shape):
        raise _Refused(f"a tensor of size {shape} has stride {steps}")
    if type(requires_grad) is not bool:
        raise _Refused(f"requires_grad must be a bool, got {_short(requires_grad)}")
    if hooks is not None and (not isinstance(hooks, dict) or hooks):
        raise _Refused("a tensor with backward hooks")
    if storage.code not in (UNTYPED, code):
        raise _Refused(f"storage {storage.key!r} holds {storage.code} but a tensor reads it "
                       f"as {code}")
    return TensorRef(storage, code, _index(offset, "a storage offset"), shape, steps)


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                       hooks: Any, metadata: Any = None) -> TensorRef:
    code = storage.code if isinstance(storage, StorageRef) else None
    if code == UNTYPED:
        raise _Refused("_rebuild_tensor_v2 on an untyped storage (a dtype is needed)")
    return _tensor(storage, offset, size, stride, code or "", requires_grad, hooks)


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                       hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not (isinstance(dtype, _StandIn) and isinstance(dtype.value, str)):
        raise _Refused(f"_rebuild_tensor_v3 needs a torch dtype, got {_short(dtype)}")
    if isinstance(storage, StorageRef) and storage.code == UNTYPED:
        storage.code = dtype.value      # the tensor types the bytes; a second dtype conflicts
        storage.numel //= torch_itemsize(dtype.value)
    return _tensor(storage, offset, size, stride, dtype.value, requires_grad, hooks)


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any, state: Any = None) -> Any:
    if not isinstance(data, TensorRef):
        raise _Refused(f"a Parameter must wrap a tensor, got {_short(data)}")
    return data


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if not (isinstance(new_type, _StandIn) and new_type.value == "tensor-type"):
        raise _Refused(f"tensor subclass {_short(new_type)}")
    if not (isinstance(func, _StandIn) and func.name.startswith("torch._utils._rebuild_")
            and isinstance(args, tuple) and len(args) <= MAX_ARGS):
        raise _Refused("_rebuild_from_type_v2 needs a tensor rebuild function and its "
                       "arguments")
    return func(*args)


def _ordered_dict(*args: Any) -> StateDict:
    if args and not (len(args) == 1 and isinstance(args[0], (list, tuple))):
        raise _Refused("OrderedDict takes at most a list of pairs")
    result = StateDict()
    for pair in args[0] if args else ():
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise _Refused("OrderedDict takes a list of pairs")
        result[_key(pair[0])] = pair[1]
    return result


def _plain(kind: type, *takes: type) -> Callable[..., Any]:
    """A builder of `kind` from no argument or one of the types `takes` (never an int
    for a bytearray: bytearray(n) would allocate n bytes)."""
    def build(*args: Any) -> Any:
        if len(args) > 1 or (args and not isinstance(args[0], takes)):
            raise _Refused(f"{kind.__name__}() of {_short(args)}")
        if kind in (set, frozenset) and args:
            for item in args[0]:
                _key(item)
        return kind(*args)
    return build


def _encode(text: Any, encoding: Any = "latin1") -> bytes:
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise _Refused("_codecs.encode is allowed only for latin1 text (pickled bytes)")
    return text.encode("latin1")


def _device(*args: Any) -> str:
    if not args or len(args) > 2 or type(args[0]) is not str or len(args[0]) > 64 or (
            len(args) == 2 and not (type(args[1]) is int and 0 <= args[1] < 2**31)):
        raise _Refused(f"torch.device{_short(args)}")
    return args[0] if len(args) == 1 else f"{args[0]}:{args[1]}"


def _key(key: Any) -> Any:
    """`key`, when it may be hashed as a dict key or set item in time bounded by
    its own bytes, with no collision a pickle could arrange."""
    kind = type(key)
    if kind in (str, bytes, bool, float, type(None), _StandIn, StorageRef, TensorRef):
        return key      # str and bytes hashes are keyed per process; the others by identity
    if kind is int and -MAX_KEY_INT < key < MAX_KEY_INT:
        return key
    if kind is int:
        raise _Refused(f"an int dict key or set item of {key.bit_length()} bits (past 2**61, "
                       f"ints share hashes)")
    raise _Refused(f"a dict key or set item of type {kind.__name__}: only str, bytes, int, "
                   f"float, bool and None are hashed (a {kind.__name__}'s hash could take "
                   f"time far beyond its size)")


def _allowed_globals() -> Dict[str, _StandIn]:
    allowed: Dict[str, _StandIn] = {}

    def add(name: str, build: Optional[Callable[..., Any]] = None, value: Any = None) -> None:
        allowed[name] = _StandIn(name, build, value)

    add("collections.OrderedDict", _ordered_dict)
    add("torch.Size", _size)
    add("torch.device", _device)
    add("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2)
    add("torch._utils._rebuild_tensor_v3", _rebuild_tensor_v3)
    add("torch._utils._rebuild_parameter", _rebuild_parameter)
    add("torch._utils._rebuild_parameter_with_state", _rebuild_parameter)
    add("torch._tensor._rebuild_from_type_v2", _rebuild_from_type)
    add("torch.Tensor", value="tensor-type")
    add("torch.nn.parameter.Parameter", value="tensor-type")
    add("_codecs.encode", _encode)
    for module in ("builtins", "__builtin__"):
        add(f"{module}.set", _plain(set, list, tuple, str, bytes))
        add(f"{module}.frozenset", _plain(frozenset, list, tuple, str, bytes))
        add(f"{module}.complex", _plain(complex, int, float, str))
        add(f"{module}.bytearray", _plain(bytearray, list, tuple, bytes))
    for torch_name, code in CODE_OF_TORCH_NAME.items():
        add(f"torch.{torch_name}", value=code)
    for torch_name in TORCH_DTYPE_NAMES:
        allowed.setdefault(f"torch.{torch_name}", _StandIn(f"torch.{torch_name}",
                                                           value=("no code", torch_name)))
    for class_name, torch_name in STORAGE_CLASSES.items():
        add(f"torch.{class_name}", value=("storage", torch_name))
    add("torch.UntypedStorage", value=("storage", UNTYPED))
    add("torch.storage.UntypedStorage", value=("storage", UNTYPED))
    return allowed


ALLOWED_GLOBALS = _allowed_globals()


def _refuse_opcode(name: str) -> Callable[[Any], None]:
    def refuse(self: Any) -> None:
        raise _Refused(f"the pickle opcode {name} (it builds arbitrary objects)")
    return refuse


SIZED = (str, bytes, bytearray, list, tuple, dict, set, frozenset, StateDict)


def _load_reduce(self: Any) -> None:
    stack = self.stack
    args = stack.pop()
    func = stack[-1]
    if not isinstance(func, _StandIn) or not isinstance(args, tuple):
        raise _Refused(f"REDUCE of {_short(func)}: only the allowed globals may be called")
    if len(args) > MAX_ARGS:
        raise _Refused(f"REDUCE of {func.name} with {len(args)} arguments")
    self.charge(1 + sum(len(arg) for arg in args if type(arg) in SIZED))
    stack[-1] = func(*args)


def _load_setitem(self: Any) -> None:
    stack = self.stack
    value = stack.pop()
    key = _key(stack.pop())
    stack[-1][key] = value


def _load_setitems(self: Any) -> None:
    items = self.pop_mark()
    target = self.stack[-1]
    for position in range(0, len(items), 2):
        target[_key(items[position])] = items[position + 1]


def _load_dict(self: Any) -> None:
    items = self.pop_mark()
    self.append({_key(items[position]): items[position + 1]
                 for position in range(0, len(items), 2)})


def _load_additems(self: Any) -> None:
    items = self.pop_mark()
    target = self.stack[-1]
    for item in items:
        target.add(_key(item))


def _load_frozenset(self: Any) -> None:
    items = self.pop_mark()
    self.append(frozenset(_key(item) for item in items))


def _memo_index(self: Any) -> int:
    """The index of a PUT or GET (text, protocol 0): big ints would collide in
    the memo's dict."""
    text = self.readline()[:-1]
    if not (text.isdigit() and len(text) <= 10 and int(text) < MAX_MEMO_INDEX):
        raise _Refused(f"memo index {_short(text)}")
    return int(text)


def _load_put(self: Any) -> None:
    self.memo[_memo_index(self)] = self.stack[-1]


def _load_get(self: Any) -> None:
    self.append(self.memo[_memo_index(self)])


def _load_build(self: Any) -> None:
    stack = self.stack
    state = stack.pop()
    target = stack[-1]
    if not isinstance(target, (StateDict, StorageRef, TensorRef, _StandIn)):
        raise _Refused(f"BUILD on a {type(target).__name__}: only a state dict's "
                       f"OrderedDict may have its state set")
    target.__setstate__(state)


def _load_bytearray8(self: Any) -> None:
    """BYTEARRAY8, its bytes read before the bytearray is made: Python's unpickler
    allocates the length the pickle declares first, however few bytes follow."""
    length, = struct.unpack("<Q", self.read(8))
    data = self.read(length)
    if len(data) < length:
        raise EOFError
    self.append(bytearray(data))


_BASE = pickle._Unpickler       # the pure-Python unpickler: its opcodes can be replaced
_DISPATCH: Dict[int, Any] = dict(_BASE.dispatch)
_DISPATCH[pickle.REDUCE[0]] = _load_reduce
_DISPATCH[pickle.BUILD[0]] = _load_build
_DISPATCH[pickle.BYTEARRAY8[0]] = _load_bytearray8
_DISPATCH[pickle.SETITEM[0]] = _load_setitem
_DISPATCH[pickle.SETITEMS[0]] = _load_setitems
_DISPATCH[pickle.DICT[0]] = _load_dict
_DISPATCH[pickle.ADDITEMS[0]] = _load_additems
_DISPATCH[pickle.FROZENSET[0]] = _load_frozenset
_DISPATCH[pickle.PUT[0]] = _load_put
_DISPATCH[pickle.GET[0]] = _load_get
for _name in ("INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "NEXT_BUFFER",
              "READONLY_BUFFER"):
    _DISPATCH[getattr(pickle, _name)[0]] = _refuse_opcode(_name)


class RestrictedUnpickler(_BASE):
    """The pickle of a torch checkpoint, run with the allowed globals only.

    `storage` is called as ``storage(key, code, numel)`` for every storage
    reference; `legacy` accepts the 6-field references of the pre-zip format.
    The calls of allowed globals may spend `WORK_PER_BYTE` units of work per
    byte of the pickle's `size` (plus WORK_BASE); `work` counts those spent.
    """
    dispatch = _DISPATCH

    def __init__(self, file: Any, storage: Callable[[str, str, int], StorageRef],
                 legacy: bool = False, size: int = 0) -> None:
        super().__init__(file, encoding="utf-8")
        self._storage = storage
        self._legacy = legacy
        self.work = 0
        self.max_work = WORK_BASE + WORK_PER_BYTE * size

    def charge(self, units: int) -> None:
        """Count `units` of work; past the pickle's budget, refuse it."""
        self.work += units
        if self.work > self.max_work:
            raise _Refused(f"the pickle asks for more than {self.max_work} units of work, "
                           f"the most its size allows (it hands the same large values to "
                           f"calls over and over)")

    def find_class(self, module: str, name: str) -> Any:
        stand_in = ALLOWED_GLOBALS.get(f"{module}.{name}")
        if stand_in is None:
            raise _Refused(f"refusing the global {_short(module + '.' + name)}: a checkpoint "
                           f"of tensors never needs it, and loading it could run code")
        if isinstance(stand_in.value, tuple) and stand_in.value[0] == "no code":
            raise SafetensorTypeError(f"torch.{stand_in.value[1]} has no safetensors dtype")
        return stand_in

    def persistent_load(self, pid: Any) -> StorageRef:
        fields = 6 if self._legacy else 5
        if not (isinstance(pid, tuple) and len(pid) == fields and pid[0] == "storage"):
            raise _Refused(f"persistent id {_short(pid)}: expected a {fields}-field storage "
                           f"reference")
        kind, key, numel = pid[1], pid[2], pid[4]
        if self._legacy and pid[5] is not None:
            raise _Refused("storage views (pre-1.0 checkpoints) are not supported")
        if not (isinstance(kind, _StandIn) and isinstance(kind.value, tuple)
                and kind.value[0] == "storage"):
            raise _Refused(f"persistent id names {_short(kind)}, not a storage class")
        if type(key) is not str:
            raise _Refused(f"storage key {_short(key)} is not a str")
        torch_name = kind.value[1]
        if torch_name == UNTYPED:
            code = UNTYPED
        else:
            code = CODE_OF_TORCH_NAME.get(torch_name, "")
            if not code:
                raise SafetensorTypeError(f"storage {key!r}: torch.{torch_name} has no "
                                          f"safetensors dtype")
        return self._storage(key, code, _index(numel, f"storage {key!r}'s size"))


class BoundedFile:
    """A file object for the unpickler: a read past `end` is refused, so a length
    in the pickle cannot make Python allocate for bytes that are not there."""

    def __init__(self, raw: Any, end: int) -> None:
        self._raw, self._end = raw, end

    def read(self, size: int = -1) -> bytes:
        left = self._end - self._raw.tell()
        if size is None or size < 0:
            size = left
        if size > left:
            raise _Refused(f"the pickle is truncated or asks for more than it holds: "
                           f"{size} bytes wanted, {left} left")
        data: bytes = self._raw.read(size)
        return data

    def readline(self) -> bytes:
        line: bytes = self._raw.readline(max(self._end - self._raw.tell(), 0))
        return line


def load_pickle(raw: Any, end: int, source: str,
                storage: Callable[[str, str, int], StorageRef], legacy: bool = False) -> Any:
    """Unpickle one pickle from file object `raw` (ending at byte `end`) with the
    restricted unpickler; every failure is a SafetensorError naming `source`."""
    # An in-memory pickle needs no bound: BytesIO hands back what it holds.
    file = raw if isinstance(raw, io.BytesIO) else BoundedFile(raw, end)
    unpickler = RestrictedUnpickler(file, storage, legacy, size=end - raw.tell())
    try:
        return unpickler.load()
    except SafetensorError as error:
        kind = SafetensorError if isinstance(error, _Refused) else type(error)
        raise kind(f"{source}: {error}") from None
    except RecursionError:
        raise SafetensorError(f"{source}: the pickle nests too deeply") from None
    except EOFError:
        raise SafetensorError(f"{source}: the pickle is truncated") from None
    except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, UnicodeDecodeError, OverflowError, MemoryError,
            struct.error) as error:
        raise SafetensorError(f"{source}: malformed pickle ({type(error).__name__}: "
                              f"{_short(str(error))})") from None


def loads(data: bytes, source: str = "<pickle>") -> Any:
    """Unpickle `data` with the restricted unpickler, storages numbered as they
    come (for tests and the fuzz target)."""
    storages: Dict[str, StorageRef] = {}

    def storage(key: str, code: str, numel: int) -> StorageRef:
        return storages.setdefault(key, StorageRef(key, code, numel))

    return load_pickle(io.BytesIO(data), len(data), source, storage)
