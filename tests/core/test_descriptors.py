"""A mapped handle holds no file descriptor: thousands can be open at once, reads work
while descriptors are exhausted, and copies still catch a file that changed."""
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import fastst
from pages import descriptors_on

resource = pytest.importorskip("resource")


DESCRIPTOR_HELPERS = """
import errno, os

def take_every_descriptor():
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as error:
        assert error.errno == errno.EMFILE
    return held

def release(held):
    for fd in held:
        os.close(fd)
"""


def run_python(code: str) -> str:
    """Run `code` in a fresh interpreter, after DESCRIPTOR_HELPERS; its stdout."""
    script = DESCRIPTOR_HELPERS + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", script],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_ten_thousand_mapped_handles_under_a_limit_of_64_descriptors(tmp_path):
    path = tmp_path / "small.safetensors"
    fastst.save_file({"t": np.arange(4, dtype=np.int32)}, path)
    out = run_python(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        import fastst
        handles = [fastst.safe_open({str(path)!r}, "np") for _ in range(10_000)]
        total = sum(int(handle.get_tensor("t").sum()) for handle in handles)
        print(len(handles), total)
    """)
    assert out.split() == ["10000", str(10_000 * 6)]


def test_reads_need_no_free_descriptor(tmp_path):
    """Views of BF16 and F8 tensors (whose dtypes come from ml_dtypes) are served
    while every descriptor is taken."""
    path = tmp_path / "wide.safetensors"
    fastst.save_file({"b": np.arange(4).astype(ml_dtypes.bfloat16),
                      "f": np.arange(4).astype(ml_dtypes.float8_e4m3fn),
                      "i": np.arange(4, dtype=np.int16)}, path)
    out = run_python(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        import fastst
        assert "ml_dtypes" not in sys.modules
        handle = fastst.safe_open({str(path)!r}, "np")
        held = take_every_descriptor()
        values = [float(handle.get_tensor(name).astype("float32").sum())
                  for name in ("b", "f", "i")]
        names = handle.keys()
        release(held)
        print(values, names)
    """)
    assert out.strip() == "[6.0, 6.0, 6.0] ['b', 'f', 'i']"


def test_pread_copies_need_no_free_descriptor(tmp_path):
    """A pread handle keeps its own descriptor; a copy large enough to use threads
    works while every other descriptor is taken."""
    path = tmp_path / "large.safetensors"
    fastst.save_file({"a": np.full(40 << 20, 1, np.uint8),
                      "b": np.full(40 << 20, 2, np.uint8)}, path)
    out = run_python(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        import fastst
        handle = fastst.safe_open({str(path)!r}, "np", backend="pread")
        held = take_every_descriptor()
        tensors = handle.copy_tensors()
        release(held)
        print(int(tensors["a"].sum()), int(tensors["b"].sum()))
    """)
    assert out.split() == [str(40 << 20), str(80 << 20)]


def make(tmp_path, nbytes=1 << 16):
    path = tmp_path / "model.safetensors"
    fastst.save_file({"a": np.arange(nbytes, dtype=np.uint8),
                      "b": np.arange(nbytes, dtype=np.uint8)}, path)
    return path


def copies(handle):
    return {
        "copy_tensors": lambda: handle.copy_tensors(),
        "get_tensor out": lambda: handle.get_tensor("b", out=np.empty(1 << 16, np.uint8)),
        "read_into": lambda: handle.read_into({"b": np.empty(1 << 16, np.uint8)}),
        "gather_rows": lambda: handle.gather_rows("b", np.array([65535], np.intp)),
    }


def test_copies_from_a_mapped_handle_report_a_truncated_file(tmp_path):
    path = make(tmp_path)
    with fastst.safe_open(path, "np") as handle:
        os.truncate(path, 4096)
        for name, copy in copies(handle).items():
            with pytest.raises(fastst.SafetensorError, match="truncated"):
                copy()


def test_copies_from_a_mapped_handle_report_a_replaced_file(tmp_path):
    path = make(tmp_path)
    with fastst.safe_open(path, "np") as handle:
        fastst.save_file({"a": np.zeros(2, np.uint8)}, tmp_path / "other.safetensors")
        os.replace(tmp_path / "other.safetensors", path)
        for name, copy in copies(handle).items():
            with pytest.raises(fastst.SafetensorError, match="replaced"):
                copy()
        np.testing.assert_array_equal(handle.get_tensor("a")[:3], [0, 1, 2])


def test_copies_from_a_mapped_handle_read_the_file(tmp_path):
    path = make(tmp_path)
    with fastst.safe_open(path, "np") as handle:
        tensors = handle.copy_tensors()
        out = np.empty(1 << 16, np.uint8)
        handle.get_tensor("b", out=out)
    expected = np.arange(1 << 16, dtype=np.uint8)
    np.testing.assert_array_equal(tensors["a"], expected)
    np.testing.assert_array_equal(out, expected)


def test_a_mapped_handle_keeps_no_descriptor_and_pread_keeps_one(tmp_path):
    path = make(tmp_path)
    mapped = fastst.safe_open(path, "np")
    assert descriptors_on(path) == 0
    reading = fastst.safe_open(path, "np", backend="pread")
    assert descriptors_on(path) == 1
    reading.close()
    mapped.close()
    assert descriptors_on(path) == 0


def test_a_relative_path_is_reopened_from_where_it_was_opened(tmp_path, monkeypatch):
    make(tmp_path)
    monkeypatch.chdir(tmp_path)
    with fastst.safe_open("model.safetensors", "np") as handle:
        monkeypatch.chdir(tmp_path.parent)
        assert handle.copy_tensors()["b"][-1] == 255
