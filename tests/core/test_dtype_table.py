"""Every list of dtypes agrees with the one table, ``fastst.DTYPES``."""
import ast
import pathlib
import re

import numpy as np
import pytest

import fastst
from conftest import WRITABLE_DTYPES

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_table_itself():
    assert fastst.DTYPE_CODES == tuple(row.code for row in fastst.DTYPES)
    assert len(set(fastst.DTYPE_CODES)) == len(fastst.DTYPES)
    assert all(isinstance(row, fastst.DtypeInfo) for row in fastst.DTYPES)
    assert fastst.DtypeInfo._fields == ("code", "bits", "numpy", "torch")
    for row in fastst.DTYPES:
        assert row.bits in (4, 6, 8, 16, 32, 64)
        assert (row.numpy == "uint8") if row.bits < 8 else True


def documented_dtype_rows():
    """(code, bits, NumPy dtype name, torch dtype name or None) from the table of the
    docs' Dtypes page."""
    text = (ROOT / "docs" / "guide" / "dtypes.md").read_text()
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        code, bits, numpy_cell, torch_cell = (cell.strip() for cell in line.strip("|").split("|"))
        numpy_name = re.search(r"`(?:ml_dtypes\.)?(\w+)`", numpy_cell).group(1)
        torch_name = re.search(r"`torch\.(\w+)`", torch_cell)
        rows.append((code.strip("`"), int(bits), numpy_name,
                     torch_name.group(1) if torch_name else None))
    return rows


def test_documented_table_is_the_table():
    assert documented_dtype_rows() == [tuple(row) for row in fastst.DTYPES]


def test_writable_dtypes_are_the_whole_byte_rows(tmp_path):
    whole_bytes = [row for row in fastst.DTYPES if row.bits >= 8]
    assert list(WRITABLE_DTYPES) == [row.code for row in whole_bytes]
    path = tmp_path / "every.safetensors"
    fastst.save_file({row.code: np.zeros(2, WRITABLE_DTYPES[row.code]) for row in whole_bytes},
                     path)
    with fastst.safe_open(path) as f:
        for row in whole_bytes:
            dtype = WRITABLE_DTYPES[row.code]
            assert (dtype.name, dtype.itemsize * 8) == (row.numpy, row.bits)
            assert f.info(row.code).dtype == row.code


def stub_tree():
    return ast.parse((ROOT / "fastst" / "_core" / "dtypes.pyi").read_text())


def test_stubs_declare_the_table():
    tree = stub_tree()
    (info,) = [node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == "DtypeInfo"]
    fields = [(node.target.id, ast.unparse(node.annotation)) for node in info.body
              if isinstance(node, ast.AnnAssign)]
    assert fields == [("code", "str"), ("bits", "int"), ("numpy", "str"),
                      ("torch", "str | None")]
    assert tuple(name for name, _ in fields) == fastst.DtypeInfo._fields
    declared = {node.target.id: ast.unparse(node.annotation) for node in tree.body
                if isinstance(node, ast.AnnAssign)}
    assert declared["DTYPES"] == "Final[tuple[DtypeInfo, ...]]"
    assert declared["DTYPE_CODES"] == "Final[tuple[str, ...]]"


def test_every_literal_list_of_codes_in_the_stubs_is_complete():
    for node in ast.walk(stub_tree()):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
            values = {ast.literal_eval(element) for element in
                      (node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice])}
            if values & set(fastst.DTYPE_CODES):
                assert values == set(fastst.DTYPE_CODES)


def test_fuzz_dictionary_holds_every_code():
    text = (ROOT / "fuzz" / "safetensors.dict").read_text()
    for code in fastst.DTYPE_CODES:
        assert f'"\\"{code}\\""' in text


def test_torch_adapter_maps_each_code_to_the_table_s_torch_dtype():
    torch = pytest.importorskip("torch")
    import fastst.torch

    mapping = fastst.torch.TORCH_DTYPES
    assert set(mapping) <= set(fastst.DTYPE_CODES)
    for row in fastst.DTYPES:
        if row.torch is not None and hasattr(torch, row.torch):
            assert mapping[row.code] == getattr(torch, row.torch), row.code
        else:
            assert mapping.get(row.code) is None, row.code
