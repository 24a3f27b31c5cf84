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
