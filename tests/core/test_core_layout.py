"""The compiled core's tables all come from DTYPES, and nothing outside the core
reaches for its private names."""
import os
import pathlib
import re

import numpy as np
import pytest

import fastst
from fastst import _core

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_dtype_list_is_the_table():
    assert fastst.DTYPE_CODES == tuple(row.code for row in fastst.DTYPES)
    for row in fastst.DTYPES:
        assert _core.dtype_bits(row.code) == row.bits
        assert _core.numpy_dtype(row.code).name == row.numpy
        assert _core.numpy_dtype(row.code).byteorder in "<|="
        if not row.numpy.startswith(("bfloat", "float8")):
            assert _core.numpy_dtype(row.code) is np.dtype(row.numpy)   # NumPy's own object


@pytest.mark.parametrize("row", fastst.DTYPES, ids=lambda row: row.code)
def test_the_fast_scanner_knows_every_code_of_the_table(row):
    """A canonical header (the scanner's path) of each dtype reads back."""
    shape = [2, 8] if row.bits < 8 else [2]
    nbytes = 2 * 8 * row.bits // 8 if row.bits < 8 else 2 * row.bits // 8
    header = ('{"t":{"dtype":"%s","shape":%s,"data_offsets":[0,%d]}}'
              % (row.code, str(shape).replace(" ", ""), nbytes)).encode()
    reader = _core.Reader()
    reader.open_buffer(len(header).to_bytes(8, "little") + header + bytes(nbytes))
    assert reader.info("t").dtype == row.code
    assert reader.get_tensor("t").dtype == _core.numpy_dtype(row.code)


def test_unknown_codes_are_refused():
    for code in ("F32 ", "f32", "", "F8_E4M3FNUZX"):
        with pytest.raises(fastst.SafetensorError, match="unknown dtype"):
            _core.dtype_bits(code)


def python_sources():
    for folder in ("fastst", "bench", "fuzz"):
        yield from (ROOT / folder).glob("**/*.py")


def test_no_module_uses_a_private_name_of_the_core():
    private = re.compile(r"_core\._(?!ring\b)\w+")   # _core._ring: the ring's extension
    offenders = [f"{path.relative_to(ROOT)}: {match}" for path in python_sources()
                 for match in private.findall(path.read_text())]
    assert offenders == []


def test_copies_work_without_sched_getaffinity(tmp_path, monkeypatch):
    """Large copies use threads; where the platform has no CPU affinity (macOS) the
    CPU count is used."""
    path = tmp_path / "large.safetensors"
    tensors = {f"t{k}": np.full(9 << 20, k, np.uint8) for k in range(8)}
    fastst.save_file(tensors, path)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    loaded = fastst.load_file(path, copy=True)
    for name, expected in tensors.items():
        np.testing.assert_array_equal(loaded[name], expected)


CORE = ROOT / "fastst" / "_core"
# What only some systems have, each allowed outside platform.h only under the feature
# platform.h defines where the system has it.
GUARDED = {r"\bMADV_POPULATE_READ\b": "FASTST_CAN_POPULATE",
           r"\bMADV_HUGEPAGE\b": "FASTST_CAN_HUGE_PAGES",
           r"\binotify_\w+|\bIN_[A-Z_]+\b": "FASTST_CAN_WATCH"}
# What goes through platform.h's own functions alone, and the tests of a system.
PLATFORM_ONLY = re.compile(r"\b(posix_fadvise|f?statfs|pthread_setname_np|mincore|preadv2)\s*\(|"
                           r"__linux__|__APPLE__|_WIN32|<sys/(inotify|vfs|mount)\.h>")


def active_features(lines):
    """For each line of a C file, the FASTST_CAN_* features whose #ifdef it is in."""
    stack, active = [], []
    for line in lines:
        directive = line.strip()
        if directive.startswith("#if"):
            found = re.match(r"#ifdef\s+(FASTST_CAN_\w+)", directive)
            stack.append(found.group(1) if found else None)
        elif directive.startswith(("#else", "#elif")):
            stack[-1] = None
        elif directive.startswith("#endif"):
            stack.pop()
        active.append({feature for feature in stack if feature})
    return active


def code_lines(path):
    """The lines of a C file, its comments blanked."""
    text = re.sub(r"/\*.*?\*/", lambda comment: "\n" * comment.group().count("\n"),
                  path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text).splitlines()


def test_what_only_some_systems_have_is_guarded_in_one_place():
    """Outside platform.h, the core's C tests no system and calls what only some have
    through platform.h, or under the feature platform.h defines where it is there:
    what keeps it compiling for macOS (`nox -s macos` compiles it)."""
    offenders = []
    for path in sorted(CORE.glob("*.h")):
        if path.name == "platform.h":
            continue
        lines = code_lines(path)
        for number, (line, features) in enumerate(zip(lines, active_features(lines)), 1):
            if PLATFORM_ONLY.search(line):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
            offenders += [f"{path.name}:{number}: {line.strip()} (not under {feature})"
                          for pattern, feature in GUARDED.items()
                          if re.search(pattern, line) and feature not in features]
    assert offenders == []


def test_no_compiled_code_cimports_what_only_linux_declares():
    cimports = [f"{path.name}: {line}" for path in CORE.glob("*.p[yx][xi]")
                for line in path.read_text().splitlines()
                if re.match(r"\s*from posix\.fcntl cimport", line)]
    assert cimports == []


def test_files_read_ahead_without_posix_fadvise(tmp_path, monkeypatch):
    """Where Python has no posix_fadvise (macOS), asking for a tensor ahead asks the
    kernel for nothing, and reads go on."""
    path = tmp_path / "x.safetensors"
    fastst.save_file({"x": np.arange(1 << 20, dtype=np.float32)}, path)
    with fastst.safe_open(path) as f:
        assert f.will_need(["x"]) == 4 << 20
        monkeypatch.delattr(os, "posix_fadvise")
        assert f.will_need(["x"]) == 0
        np.testing.assert_array_equal(f.get_tensor("x"), np.arange(1 << 20, dtype=np.float32))
