"""JSON for headers, indexes and metadata: orjson, or the standard library's json
made to accept exactly what orjson accepts.

orjson 3.x declares on Python 3.13 that it needs the GIL, so importing it on a
free-threaded build turns the GIL back on for the whole process, and no release
publishes a free-threaded wheel. There the standard library decodes and encodes
instead, refusing what orjson refuses: invalid or non-strict UTF-8 (a BOM, a lone
surrogate, escaped or not), NaN and Infinity, a number that overflows a double,
more than 1024 nested arrays and objects. Like orjson it keeps the last of two
equal keys, and reads an integer outside [-2**63, 2**64) as a float. The variable
FASTST_JSON=json selects the standard library on any build (to test it).
"""
import _thread
import json      # orjson imports it too: its JSONDecodeError is json's
import os
import re
import sys
from typing import Any, Callable, Dict, Tuple, Union

# orjson's: 1024 nested arrays and objects parse, 1025 do not
MAX_DEPTH = 1024
INT_RANGE = (-2**63, 2**64)       # orjson reads an integer outside it as a float

JSONDecodeError = json.JSONDecodeError   # orjson's is a subclass: `except` catches both

# A number that may leave INT_RANGE or overflow a double has 19 digits in a row or an
# exponent: found by mapping every digit to 0 and e to e (strings give false alarms,
# which only cost the slower parse). A regular expression takes 6 times as long.
_DIGITS_AND_EXPONENTS = bytes.maketrans(b"0123456789E", b"0000000000e")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_STRUCTURE = bytes(set(range(256)) - set(b'"[]{}'))
_DEEP_PARSE = _thread.allocate_lock()


def uses_orjson() -> bool:
    """Whether loads and dumps are orjson's: not on a free-threaded build, nor
    with FASTST_JSON=json."""
    free_threaded = "t" in getattr(sys, "abiflags", "")     # sysconfig takes milliseconds
    return os.environ.get("FASTST_JSON") != "json" and not free_threaded


def loads(data: Union[bytes, str]) -> Any:
    """The value of the JSON text `data`, as orjson.loads reads it; JSONDecodeError
    where orjson refuses it."""
    return _LOADS(data)


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON, as orjson.dumps writes it for str keys, ints
    in INT_RANGE, finite floats, strs, lists, bools and None (what fastst gives it);
    TypeError for a str with a lone surrogate. (Floats may be written in another
    form, 1e-07 for 1e-7: the same number.)"""
    return _DUMPS(value)


def _stdlib_loads(data: Union[bytes, str]) -> Any:
    raw, text = _utf8(data)
    hooks: Dict[str, Any] = {"parse_constant": _refuse_constant}
    if _may_hold_wide_numbers(raw):
        hooks.update(parse_int=_int, parse_float=_float)
    try:
        value = _parse(text, raw, hooks)
    except JSONDecodeError:
        raise
    except ValueError as error:        # from a hook, or int()'s digit limit
        raise JSONDecodeError(str(error), text, 0) from None
    if _depth(raw) > MAX_DEPTH:
        raise JSONDecodeError(f"depth limit exceeded ({MAX_DEPTH})", text, 0)
    if _SURROGATE_ESCAPE.search(raw) and _holds_surrogate(value):
        raise JSONDecodeError("lone surrogate in string", text, 0)
    return value


def _stdlib_dumps(value: Any) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise TypeError(f"str is not valid UTF-8: {error.reason}") from None


def _utf8(data: Union[bytes, str]) -> Tuple[bytes, str]:
    """`data` as UTF-8 bytes and as text; JSONDecodeError where it is not strict UTF-8."""
    try:
        if isinstance(data, str):
            return data.encode("utf-8"), data
        raw = bytes(data)
        return raw, raw.decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError) as error:
        raise JSONDecodeError(f"str is not valid UTF-8: {error.reason}", "", error.start) \
            from None


def _parse(text: str, raw: bytes, hooks: Dict[str, Any]) -> Any:
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        pass
    # Python 3.10 and 3.11 recurse against the recursion limit, below MAX_DEPTH.
    if _depth(raw) > MAX_DEPTH:
        raise JSONDecodeError(f"depth limit exceeded ({MAX_DEPTH})", text, 0)
    with _DEEP_PARSE:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit + 2 * MAX_DEPTH)
        try:
            return json.loads(text, **hooks)
        except RecursionError:
            raise JSONDecodeError("nesting too deep for this Python", text, 0) from None
        finally:
            sys.setrecursionlimit(limit)


def _may_hold_wide_numbers(raw: bytes) -> bool:
    mapped = raw.translate(_DIGITS_AND_EXPONENTS)
    return b"0" * 19 in mapped or b"0e" in mapped


def _depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text `raw` (exact where
    it is valid JSON), in linear time."""
    # Escaped backslashes, then escaped quotes, go: what is left of the strings is
    # a quote, the brackets they hold, and a quote.
    kept = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    if kept.count(b"[") + kept.count(b"{") <= MAX_DEPTH:
        return 0
    import numpy as np

    codes = np.frombuffer(kept, np.uint8)
    outside = np.cumsum(codes == ord('"')) % 2 == 0
    steps = (outside & ((codes == ord("[")) | (codes == ord("{")))).astype(np.int64)
    steps -= outside & ((codes == ord("]")) | (codes == ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def _holds_surrogate(value: Any) -> bool:
    """Whether a str in `value`, key or value at any depth, holds a lone surrogate."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def _int(text: str) -> Union[int, float]:
    if len(text) <= 21:
        value = int(text)
        if INT_RANGE[0] <= value < INT_RANGE[1]:
            return value
    return _float(text)


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number is infinity when parsed as double: {text[:40]}")
    return value


def _refuse_constant(text: str) -> Any:
    raise ValueError(f"unexpected character, expected a JSON value: {text}")


def _codec() -> Tuple[Callable[[Union[bytes, str]], Any], Callable[[Any], bytes]]:
    if uses_orjson():
        import orjson

        return orjson.loads, orjson.dumps
    return _stdlib_loads, _stdlib_dumps


_LOADS, _DUMPS = _codec()
