"""libFuzzer target for the ranged reader (``Reader.open_ranges``) against a lying store.

Each input is a script and a would-be safetensors file: one byte giving the script's
length, the script, then the file. The file is read through ``Reader.open_ranges``
twice, operation by operation: once with an honest fetch (the reference), once with a
fetch that the script drives. For each fetch call the script says whether the call
answers with a list of one bytes-like per range (or too few, too many, or no list),
and for each range how it is answered:

* honestly, as bytes, a bytearray, a memoryview into a larger buffer, a NumPy uint8
  array, or a NumPy array of wider items;
* with the right bytes in a strided (non-contiguous) view;
* falsely: short, long (the bytes that follow, or junk), not a bytes-like object, or
  by raising (OSError, RuntimeError, SafetensorError).

When the script runs out, every answer is honest. The script's first bytes may also
pad the header with spaces, so that the tensors start before, at or after the end of
the reader's first request (64 KiB), or the header runs past it: then tensors are
fetched by their own requests.

What the reader must do, operation by operation (opening; then, for the first few
tensors, ``get_tensor``, ``read_rows`` and ``gather``; then ``copy_tensors``):

* with a false answer: raise ``SafetensorError``, or the very exception the fetch
  raised; never return;
* with answers that were right but strided: return what the reference returns, or
  raise ``SafetensorError``;
* with honest answers only: return, or refuse, exactly as the reference does;

and it must never ask for a byte outside the file, nor, reading tensors, outside the
tensors read. Anything else (another exception, an array that differs from the
reference's, a range asked for outside those bytes, a crash, a hang, a memory blow-up)
is a finding.

Run it with ``python fuzz/fuzz_ranges.py fuzz/corpus-ranges -max_len=4096`` after
writing the seeds with ``python fuzz/fuzz_ranges.py --write-seeds fuzz/corpus-ranges``
(see ``fuzz/README.md``). Without atheris the module still imports, so tests can call
``TestOneInput`` directly.
"""
from __future__ import annotations

import os
import random
import sys
import zlib
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import ml_dtypes  # noqa: F401
import numpy as np

try:
    import atheris
except ImportError:  # the target can still be driven by hand, without coverage
    atheris = None

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fuzz_load  # noqa: E402  (fastst imported there, instrumented under atheris)
import make_corpus  # noqa: E402

sys.path.pop(0)

from fastst import SafetensorError  # noqa: E402
from fastst._core import Reader  # noqa: E402

HEAD_BYTES = 64 << 10       # the reader's first request: prefix and header, read ahead
MAX_TENSORS = 4             # tensors per input read one by one
MAX_EXTRA = 1 << 16         # most bytes a long answer adds
SOURCE = "<ranges>"

HONEST = ("bytes", "bytearray", "memoryview", "numpy", "wide")
FALSE = ("short", "long", "junk", "not-bytes", "raise-os", "raise-runtime", "raise-safetensor")
ANSWERS = HONEST + ("strided",) + FALSE
CALLS = ("too-few", "too-many", "not-a-list")   # a call's answer as a whole, rarely


class Script:
    """The input's script, read a byte at a time; 0 when it has run out."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    @property
    def left(self) -> bool:
        return self.at < len(self.data)


class LyingFetch:
    """fetch(ranges) over `data`, answering as `script` says, recording what it told
    during the current operation: a false answer, a strided one, the exception it
    raised, and any range it was asked for outside the file."""

    def __init__(self, data: bytes, script: Script) -> None:
        self.data, self.script = data, script
        self.begin(0, len(data))
        self.outside: Optional[str] = None

    def begin(self, low: int, high: int) -> None:
        """A new operation, which may ask for bytes [low, high) only."""
        self.lied = self.strided = False
        self.raised: Optional[BaseException] = None
        self.allowed = (low, high)

    def __call__(self, ranges: List[Tuple[int, int]]) -> Any:
        self.check_asked(ranges)
        call = self.script.byte() if self.script.left else 255
        if call < len(CALLS) * 4:       # about 1 call in 20 is answered wrongly as a whole
            self.lied = True
            answers = [self.data[o:o + n] for o, n in ranges]
            kind = CALLS[call % len(CALLS)]
            if kind == "too-few":
                return answers[:-1]
            if kind == "too-many":
                return answers + [b""]
            return iter(answers)
        return [self.answer(offset, length) for offset, length in ranges]

    def check_asked(self, ranges: Any) -> None:
        low, high = self.allowed
        for offset, length in ranges:
            if not (type(offset) is int and type(length) is int and low <= offset
                    and 0 <= length and offset + length <= high):
                self.outside = self.outside or (
                    f"asked for {length!r} bytes at {offset!r} where it needs only bytes "
                    f"[{low}, {high}) of the {len(self.data)}-byte file")

    def answer(self, offset: int, length: int) -> Any:
        if not self.script.left:
            return self.data[offset:offset + length]
        kind = ANSWERS[self.script.byte() % len(ANSWERS)]
        amount = self.script.byte()
        right = self.data[offset:offset + length]
        if kind in HONEST:
            return honest(kind, right)
        if kind == "strided":
            self.strided = True
            spaced = bytearray(2 * length)
            spaced[::2] = right
            return memoryview(spaced)[::2]
        if kind == "short" and length == 0:
            kind = "long"
        self.lied = True
        if kind == "short":
            return right[:length - 1 - amount % length]
        if kind == "long":
            extra = 1 + amount * amount % MAX_EXTRA
            return self.data[offset:offset + length + extra].ljust(length + extra, b"\0")
        if kind == "junk":
            return right + bytes([amount]) * (1 + amount)
        if kind == "not-bytes":
            return (str(right), None, length, list(right), {offset: length})[amount % 5]
        self.raised = {"raise-os": OSError(5, "the store failed"),
                       "raise-runtime": RuntimeError("the store broke"),
                       "raise-safetensor": SafetensorError("the store refused")}[kind]
        raise self.raised


def honest(kind: str, right: bytes) -> Any:
    """`right` as a bytes-like object of kind `kind`, each holding exactly its bytes."""
    if kind == "bytearray":
        return bytearray(right)
    if kind == "memoryview":
        return memoryview(b"<" + right + b">")[1:-1]
    if kind == "numpy":
        return np.frombuffer(right, np.uint8)
    if kind == "wide":
        for dtype in (np.uint64, np.uint32, np.uint16):
            if len(right) % np.dtype(dtype).itemsize == 0:
                return np.frombuffer(right, dtype)
    return right


# ---------------------------------------------------------------------------
# Inputs: the script, and the file with its header padded as the script says
# ---------------------------------------------------------------------------

def split_input(data: bytes) -> Tuple[Script, bytes]:
    if not data:
        return Script(b""), b""
    count = data[0]
    script = Script(data[1:1 + count])
    return script, padded(data[1 + count:], script)


def padded(data: bytes, script: Script) -> bytes:
    """`data` with its header padded with spaces (where its prefix leaves room for a
    header): the tensors starting some bytes before the first request's end (1),
    right at it (2), or the header running past it (3); unpadded (0)."""
    where, amount = script.byte() % 4, script.byte()
    if where == 0 or len(data) < 8:
        return data
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        return data
    target = {1: HEAD_BYTES - 16 * amount, 2: HEAD_BYTES, 3: HEAD_BYTES + 8 * amount + 1}[where]
    pad = max(target - 8 - length, 0)
    return ((length + pad).to_bytes(8, "little") + data[8:8 + length] + b" " * pad
            + data[8 + length:])


def joined(script: bytes, data: bytes) -> bytes:
    return bytes([len(script)]) + script + data


# ---------------------------------------------------------------------------
# Operations, run on the reference and on the reader that is lied to
# ---------------------------------------------------------------------------

Outcome = Tuple[str, Any]


def outcome(operation: Callable[[], Any]) -> Outcome:
    try:
        return "value", operation()
    except (SafetensorError, IndexError) as error:
        return "error", error
    except (OSError, RuntimeError) as error:   # raised by the lying fetch, checked below
        return "error", error


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(same_value(a[k], b[k]) for k in a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and fuzz_load._same_array(a, b)
    return bool(a == b)


def describe(result: Outcome) -> str:
    kind, value = result
    if kind == "error":
        return f"{type(value).__name__}({value})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe(('value', v))}" for k, v in value.items()) + "}"
    return fuzz_load._describe(value) if isinstance(value, np.ndarray) else repr(value)


def check(what: str, fetch: LyingFetch, got: Outcome, expected: Outcome) -> None:
    """The rules of the module's docstring for one operation."""
    assert fetch.outside is None, f"{what}: the reader {fetch.outside}"
    kind, value = got
    if kind == "error" and not isinstance(value, (SafetensorError, IndexError)):
        assert value is fetch.raised, (f"{what}: {type(value).__name__}({value}) from the "
                                       f"reader, not a SafetensorError")
    if fetch.lied:
        assert kind == "error", (f"{what}: the fetch answered falsely, and the reader returned "
                                 f"{describe(got)}")
        fuzz_load._signal(("lie refused", what.split("(")[0], type(value).__name__,
                           fuzz_load._template(str(value))))
        return
    if fetch.strided and kind == "error" and isinstance(value, SafetensorError):
        fuzz_load._signal(("strided refused", what.split("(")[0]))
        return
    if expected[0] == "error":
        assert kind == "error" and type(value) is type(expected[1]) \
            and str(value) == str(expected[1]), (
            f"{what}: honest answers, and the reader gave {describe(got)} where the "
            f"reference gives {describe(expected)}")
    else:
        assert kind == "value" and same_value(value, expected[1]), (
            f"{what}: honest answers, and the reader gave {describe(got)} where the "
            f"reference gives {describe(expected)}")
    fuzz_load._signal(("honest", what.split("(")[0], kind))


Operation = Tuple[str, Callable[[Any], Any], Tuple[int, int]]


def operations(reader: Reader, size: int, rng: random.Random) -> Iterator[Operation]:
    """(what, operation on a reader, the bytes it may ask for) for the first few
    tensors, then all of them."""
    start = reader.data_start
    for name in reader.offset_keys()[:MAX_TENSORS]:
        info = reader.info(name)
        span = (start + info.data_offsets[0], start + info.data_offsets[1])
        yield f"get_tensor({name!r})", lambda r, n=name: r.get_tensor(n), span
        rows = info.array_shape[0] if info.array_shape else 0
        first = rng.randint(0, rows)
        last = rng.randint(first, rows)
        yield (f"read_rows({name!r}, {first}, {last})",
               lambda r, n=name, a=first, b=last: r.read_rows(n, a, b), span)
        if rows:
            wanted = [rng.randrange(-rows, rows) for _ in range(rng.randint(1, 6))]
            yield (f"gather({name!r}, {wanted})", lambda r, n=name, w=wanted: r.gather(n, w),
                   span)
    yield "copy_tensors()", lambda r: r.copy_tensors(), (start, size)


def opened(reader: Reader, file: bytes, fetch: LyingFetch) -> Any:
    """What opening `reader` on `file` gives: its tensors' names and its metadata."""
    reader.open_ranges(SOURCE, len(file), fetch)
    return reader.offset_keys(), reader.metadata()


def TestOneInput(data: bytes) -> None:
    script, file = split_input(data)
    honest_fetch = LyingFetch(file, Script(b""))
    lying_fetch = LyingFetch(file, script)
    reference, lied_to = Reader(), Reader()
    expected = outcome(lambda: opened(reference, file, honest_fetch))
    got = outcome(lambda: opened(lied_to, file, lying_fetch))
    assert honest_fetch.outside is None, f"open_ranges: the reader {honest_fetch.outside}"
    check("open_ranges", lying_fetch, got, expected)
    if expected[0] == "error" or got[0] == "error":
        return
    rng = random.Random(zlib.crc32(file))
    for what, operation, span in operations(reference, len(file), rng):
        honest_fetch.begin(*span)
        expected = outcome(lambda: operation(reference))
        assert honest_fetch.outside is None, f"{what}: the reader {honest_fetch.outside}"
        lying_fetch.begin(*span)
        got = outcome(lambda: operation(lied_to))
        check(what, lying_fetch, got, expected)


# ---------------------------------------------------------------------------
# Seeds and mutation
# ---------------------------------------------------------------------------

# Scripts: the padding (where, amount), then for each call a byte (12 and over: one
# answer per range), and for each range a kind (an index into ANSWERS) and an amount.
SCRIPTS = {
    "honest": b"",
    "honest-kinds": bytes([2, 0, 40, 1, 0, 40, 2, 0, 40, 3, 0, 40, 4, 0, 40, 0, 0]),
    "after-head-short": bytes([2, 0, 40, 0, 0, 40, 6, 3]),
    "after-head-long": bytes([2, 0, 40, 0, 0, 40, 7, 200]),
    "straddle-junk": bytes([1, 2, 40, 0, 0, 40, 8, 9]),
    "long-header-raise": bytes([3, 5, 40, 0, 0, 40, 10, 0]),
    "strided": bytes([2, 0, 40, 5, 0, 40, 5, 0]),
    "too-few": bytes([2, 0, 40, 0, 0, 0]),
}


def seeds() -> Iterator[Tuple[str, bytes]]:
    """Small files written by fastst.save and crafted ones, each with every script."""
    files = [data for _, data in make_corpus.saved_seeds() if len(data) <= 2048][:12]
    files += [data for _, data in make_corpus.validation_seeds() if len(data) <= 512][:12]
    for k, data in enumerate(files):
        for name, script in SCRIPTS.items():
            yield f"{name}-{k:02d}", joined(script, data)


def _custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    """The script or the file changed on its own, or the input as bytes."""
    rng = random.Random(seed)
    count = data[0] if data else 0
    script, file = data[1:1 + count], data[1 + count:]
    choice = rng.random()
    if choice < 0.35:
        script = atheris.Mutate(script, 255)
        return joined(script, file)[:max_size]
    if choice < 0.7:
        mutated = fuzz_load.mutate_structure(file, rng, max(max_size - 1 - len(script), 0))
        if mutated is not None:
            return joined(script, mutated)
    return atheris.Mutate(data, max_size)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        os.makedirs(sys.argv[2], exist_ok=True)
        for name, data in seeds():
            with open(os.path.join(sys.argv[2], name), "wb") as fh:
                fh.write(data)
        return
    if atheris is None:
        sys.exit("fuzz_ranges.py needs atheris: pip install atheris")
    atheris.Setup(sys.argv, TestOneInput, custom_mutator=_custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
