"""Writes: determinism, atomic replacement, file modes and input checking."""
import errno
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import fastst


def test_output_does_not_depend_on_insertion_order():
    a, b, c = np.ones(3, np.float32), np.zeros(2, np.int8), np.arange(4, dtype=np.float64)
    one = fastst.save({"a": a, "b": b, "c": c}, metadata={"x": "1", "y": "2", "z": "3"})
    two = fastst.save({"c": c, "b": b, "a": a}, metadata={"z": "3", "x": "1", "y": "2"})
    assert one == two
    assert one.index(b'{"__metadata__":{"x":"1","y":"2","z":"3"}') == 8


def test_save_file_writes_the_same_bytes_as_save(tmp_path):
    tensors = {"w": np.arange(10, dtype=np.int16), "s": np.float64(1.0)}
    fastst.save_file(tensors, tmp_path / "f.safetensors", metadata={"k": "v"})
    assert (tmp_path / "f.safetensors").read_bytes() == fastst.save(tensors, metadata={"k": "v"})


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="write calls are counted in /proc")
def test_many_small_tensors_are_saved_in_few_write_calls(tmp_path):
    """2,000 tensors of 1 KiB to 16 KiB (17 MiB): their bytes are gathered, uncopied,
    into calls of about 4 MiB or 1,024 pieces, where a call each took 2,001 calls."""
    from pages import write_calls

    tensors = {f"t{k:04d}": np.full(256 * (1 + k % 16), k, np.float32) for k in range(2000)}
    tensors["swapped"] = np.arange(300, dtype=">i4")     # a copy, written among the others
    path = tmp_path / "many.safetensors"
    before = write_calls()
    fastst.save_file(tensors, path)
    assert write_calls() - before <= 8
    assert path.read_bytes() == fastst.save(tensors)
    assert (fastst.load_file(path)["swapped"] == np.arange(300)).all()


FAIL_MID_WRITE = """
import os, resource, signal, sys
import numpy as np
import fastst

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # past the limit, write() fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
os.posix_fallocate = lambda fd, offset, size: None    # so that the failure comes mid-write
try:
    fastst.save_file({"new": np.zeros(100_000)}, sys.argv[1])
except OSError as error:
    print("failed:", error.errno, error.filename)
"""


def test_failed_save_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.safetensors"
    fastst.save_file({"old": np.ones(4)}, path)
    before = path.read_bytes()
    result = subprocess.run([sys.executable, "-c", FAIL_MID_WRITE, str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == f"failed: {errno.EFBIG} {path}", result.stderr
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]


WRITES_TAKE_NOTHING = """
import ctypes, struct, sys
import numpy as np
from fastst.writer import plan_write, spec_of_array

# seccomp: pwrite64 and writev return 0 (SECCOMP_RET_ERRNO with errno 0) unexecuted
BLOCKED = {"x86_64": (18, 20), "aarch64": (68, 66)}[sys.argv[2]]
code = [struct.pack("<HBBI", 0x20, 0, 0, 0)]                  # load the call's number
code += [struct.pack("<HBBI", 0x15, len(BLOCKED) - k, 0, number)   # jump if equal
         for k, number in enumerate(BLOCKED)]
code += [struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000),        # allow
         struct.pack("<HBBI", 0x06, 0, 0, 0x00050000)]        # "succeed" writing nothing
program = ctypes.create_string_buffer(b"".join(code))
fprog = struct.pack("<HxxxxxxQ", len(code), ctypes.addressof(program))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0                         # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0    # SECCOMP_MODE_FILTER

plan = plan_write([spec_of_array("x", np.ones(1000))], None)
with open(sys.argv[1], "wb") as file:
    for write in (plan.write_prefix, plan.write_to):            # pwrite, writev
        try:
            write(file.fileno(), sys.argv[1])
        except OSError as error:
            print(error.errno, error.filename == sys.argv[1], flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine not in
                    ("x86_64", "aarch64"), reason="a seccomp filter of Linux's call numbers")
def test_a_write_that_takes_nothing_fails_rather_than_being_asked_forever(tmp_path):
    path = tmp_path / "x.safetensors"
    result = subprocess.run([sys.executable, "-c", WRITES_TAKE_NOTHING, str(path),
                             os.uname().machine], capture_output=True, text=True, timeout=20)
    assert result.stdout.split("\n")[:2] == [f"{errno.EIO} True"] * 2, result.stderr


def test_a_flush_that_fails_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    def failing_fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    path = tmp_path / "model.safetensors"
    with pytest.raises(OSError) as raised:
        fastst.save_file({"w": np.ones(4)}, path, fsync=True)
    assert raised.value.errno == errno.EIO and raised.value.filename == str(path)
    assert "flushing it to disk" in str(raised.value)
    assert os.listdir(tmp_path) == []


def test_invalid_input_fails_before_touching_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    fastst.save_file({"old": np.ones(4)}, path)
    with pytest.raises(TypeError):
        fastst.save_file({"ok": np.ones(2), "bad": np.array([object()])}, path)
    assert fastst.load_file(path)["old"].tolist() == [1.0] * 4
    assert os.listdir(tmp_path) == ["model.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_file_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        fastst.save_file({"x": np.ones(1)}, tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode)
    assert mode == 0o666 & ~umask


def _stream(path):
    with fastst.StreamWriter(path, {"a": ("F64", (3,))}) as writer:
        writer.write("a", np.ones(3))


def _dask(path):
    dask_array = pytest.importorskip("dask.array")
    from fastst.dask import to_safetensors

    to_safetensors({"a": dask_array.ones(3, chunks=2)}, path, scheduler="synchronous")


def _rewritten_metadata(path):
    assert not fastst.update_metadata(path, {"note": "x" * 100})     # a rewrite, not in place


# every writer of a local file; each writes `path` as a file of tensor "a"
NEW_FILE_WRITERS = {
    "save_file": lambda path: fastst.save_file({"a": np.ones(3)}, path),
    "file_url": lambda path: fastst.save_file({"a": np.ones(3)}, f"file://{path}"),
    "serialize_file": lambda path: fastst.serialize_file(
        [fastst.writer.WriteSpec("a", "F64", (3,), np.ones(3))], path),
    "save_state": lambda path: fastst.save_state(path, {"a": np.ones(3)}),
    "stream_writer": _stream,
    "dask": _dask,
}
WRITERS = {**NEW_FILE_WRITERS, "update_metadata": _rewritten_metadata}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444])
def test_a_replaced_file_keeps_its_mode(tmp_path, writer, mode):
    path = tmp_path / "m.safetensors"
    fastst.save_file({"a": np.ones(3)}, path)
    os.chmod(path, mode)
    old = os.stat(path)
    WRITERS[writer](str(path))
    new = os.stat(path)
    assert new.st_ino != old.st_ino      # a new file took the name
    assert stat.S_IMODE(new.st_mode) == mode
    assert fastst.load_file(path)["a"].tolist() == [1.0] * 3
    assert os.listdir(tmp_path) == ["m.safetensors"]


@pytest.mark.parametrize("writer", NEW_FILE_WRITERS)
def test_a_new_file_takes_the_mode_open_gives(tmp_path, writer):
    old = os.umask(0o027)
    try:
        NEW_FILE_WRITERS[writer](str(tmp_path / "m.safetensors"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode) == 0o640


def test_a_file_being_replaced_is_written_where_only_its_owner_reads_it(tmp_path):
    path = tmp_path / "m.safetensors"
    fastst.save_file({"a": np.zeros(3)}, path)
    os.chmod(path, 0o600)
    old = os.umask(0)
    try:
        with fastst.StreamWriter(path, {"a": ("F64", (3,))}) as writer:
            (temporary,) = [name for name in os.listdir(tmp_path) if name != path.name]
            assert stat.S_IMODE(os.stat(tmp_path / temporary).st_mode) == 0o600
            writer.write("a", np.ones(3))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_saving_through_a_symlink_replaces_its_target(tmp_path):
    real = tmp_path / "real.safetensors"
    link = tmp_path / "link.safetensors"
    fastst.save_file({"a": np.ones(1)}, real)
    link.symlink_to(real)
    fastst.save_file({"b": np.zeros(2)}, link)
    assert link.is_symlink()
    assert list(fastst.load_file(real)) == ["b"]


def test_fsync_mode_writes_the_same_file(tmp_path):
    fastst.save_file({"a": np.arange(3)}, tmp_path / "d.safetensors", fsync=True)
    assert fastst.load_file(tmp_path / "d.safetensors")["a"].tolist() == [0, 1, 2]


def test_overwriting_a_file_that_is_open_keeps_existing_views(tmp_path):
    path = tmp_path / "m.safetensors"
    fastst.save_file({"a": np.full(4, 7.0)}, path)
    with fastst.safe_open(path) as f:
        old = f.get_tensor("a")
        fastst.save_file({"a": np.full(4, 9.0)}, path)
        assert old.tolist() == [7.0] * 4
    assert fastst.load_file(path)["a"].tolist() == [9.0] * 4


@pytest.mark.parametrize("tensors, error, message", [
    ({1: np.ones(1)}, TypeError, "names must be str"),
    ({"__metadata__": np.ones(1)}, ValueError, "reserved"),
    ({"x": [1, 2, 3]}, TypeError, "expected a numpy.ndarray, got builtins.list"),
    ({"x": 1.5}, TypeError, "expected a numpy.ndarray"),
    ({"x": np.array(["a"])}, TypeError, "has no safetensors code"),
    ({"x": np.array([object()])}, TypeError, "object arrays"),
    ({"x": np.ones(2, np.complex128)}, TypeError, "complex128"),
    ({"x": np.zeros(2, "datetime64[s]")}, TypeError, "has no safetensors code"),
    ({"x": np.zeros(2, [("a", "<f4")])}, TypeError, "has no safetensors code"),
    ({"\ud800": np.ones(1)}, ValueError, "UTF-8"),
], ids=["int-name", "reserved-name", "list", "float", "str-array", "object-array",
        "complex128", "datetime", "structured", "lone-surrogate"])
def test_bad_tensors_are_refused_clearly(tensors, error, message):
    with pytest.raises(error, match=message):
        fastst.save(tensors)


@pytest.mark.parametrize("metadata", [{"k": 1}, {1: "v"}, ["k"], {"k": None}])
def test_bad_metadata_is_refused(metadata):
    with pytest.raises(TypeError, match="metadata"):
        fastst.save({"x": np.ones(1)}, metadata=metadata)


def test_non_dict_tensors_are_refused():
    with pytest.raises(TypeError, match="dict"):
        fastst.save([("x", np.ones(1))])


def test_empty_metadata_is_written_as_an_empty_object():
    assert b'"__metadata__":{}' in fastst.save({"x": np.ones(1)}, metadata={})
    assert b"__metadata__" not in fastst.save({"x": np.ones(1)}, metadata=None)


def test_specs_write_a_header_shape_the_source_dtype_does_not_tell(tmp_path):
    # Four 4-bit values packed in two bytes: the spec says F4 [4], the data is uint8.
    packed = np.array([0x21, 0x43], dtype=np.uint8)
    specs = [fastst.writer.WriteSpec("f4", "F4", (4,), packed),
             fastst.writer.WriteSpec("w", "F32", (2,), np.ones(2, np.float32))]
    path = tmp_path / "specs.safetensors"
    fastst.writer.serialize_file(specs, path, metadata={"k": "v"})
    assert path.read_bytes() == fastst.writer.serialize(specs, metadata={"k": "v"})
    with fastst.safe_open(path) as f:
        assert f.info("f4") == ("F4", [4], (8, 10), (2,))
        assert f.offset_keys() == ["w", "f4"]   # dtype rank descending, as the format's writers
        assert f.get_tensor("f4").tolist() == [0x21, 0x43]


@pytest.mark.parametrize("spec, message", [
    (("x", "F32", (3,), np.ones(2, np.float32)), r"shape \[3\] x F32 needs 12 bytes but the data holds 8"),
    (("x", "F4", (3,), np.ones(2, np.uint8)), "do not fill whole bytes"),
    (("x", "F33", (2,), np.ones(2, np.float32)), "unknown dtype code 'F33'"),
    (("x", "F32", (-1,), np.ones(2, np.float32)), "shape must hold unsigned integers"),
    (("x", "F32", (2**64,), np.ones(2, np.float32)), "shape must hold unsigned integers"),
    (("x", "F32", (True,), np.ones(1, np.float32)), "shape must hold unsigned integers"),
    (("x", "F32", (2**32, 2**32), np.ones(2, np.float32)), "overflows 64 bits"),
    (("x", "F32", (2,), [1.0, 2.0]), "must be a numpy.ndarray"),
    (("__metadata__", "F32", (2,), np.ones(2, np.float32)), "reserved"),
])
def test_invalid_specs_are_refused_with_the_rule_they_break(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        fastst.writer.plan_write([spec], None)


def test_a_name_given_twice_in_specs_is_refused():
    spec = fastst.writer.WriteSpec("x", "U8", (1,), np.ones(1, np.uint8))
    with pytest.raises(ValueError, match="'x' is given twice"):
        fastst.writer.plan_write([spec, spec], None)


def test_unsupported_dtypes_raise_an_error_of_both_families():
    with pytest.raises(fastst.SafetensorTypeError, match="has no safetensors code"):
        fastst.save({"s": np.array(["a"])})
    with pytest.raises(TypeError):
        fastst.save({"o": np.array([object()])})
    with pytest.raises(fastst.SafetensorError):
        fastst.save({"c": np.ones(2, np.complex128)})


def test_saves_work_where_the_platform_has_no_posix_fallocate(tmp_path, monkeypatch):
    # macOS has no os.posix_fallocate: the save must not depend on it.
    monkeypatch.delattr(os, "posix_fallocate", raising=False)
    path = tmp_path / "model.safetensors"
    fastst.save_file({"w": np.arange(1000, dtype=np.float32)}, path, fsync=True)
    assert np.array_equal(fastst.load_file(path)["w"], np.arange(1000, dtype=np.float32))
