"""What a fresh process imports for its first call. ml_dtypes, over a second of CPU to
import, loads only where an array of a dtype NumPy lacks (bfloat16, float8) is handed
out as NumPy's: never for an F32 file, a save of NumPy's own dtypes, bfloat16 read
into torch, a conversion, nor a look at a header."""
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import fastst
from conftest import modules_loaded_by
from fastst._core import Reader


@pytest.fixture
def f32_file(tmp_path):
    path = tmp_path / "f32.safetensors"
    fastst.save_file({"x": np.arange(4, dtype=np.float32)}, path)
    return path


@pytest.fixture
def wide_file(tmp_path):
    """Tensors of two dtypes ml_dtypes adds, beside one NumPy has."""
    path = tmp_path / "wide.safetensors"
    fastst.save_file({"b": np.arange(6).astype(ml_dtypes.bfloat16).reshape(2, 3),
                      "f": np.arange(4).astype(ml_dtypes.float8_e4m3fn),
                      "i": np.arange(4, dtype=np.int32)}, path)
    return path


def run_python(code: str) -> str:
    """Run `code` in a fresh interpreter; its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def run_counting_named_tuples(code: str, imports: str) -> str:
    """Run `code` in a fresh interpreter after `imports`, with the name of every named
    tuple type made from then on in the list `made`; its stdout."""
    return run_python(f"""
import collections, sys
{imports}
made, namedtuple = [], collections.namedtuple
def counted(name, *args, **kwargs):
    made.append(name)
    return namedtuple(name, *args, **kwargs)
collections.namedtuple = counted
{textwrap.dedent(code)}""")


def test_a_first_load_of_an_f32_file_imports_no_ml_dtypes(f32_file):
    assert modules_loaded_by(f"import fastst; fastst.load_file({str(f32_file)!r})",
                             ["ml_dtypes"]) == []


def test_a_first_load_makes_no_named_tuple_type_and_imports_no_type_only_module(f32_file):
    """A named tuple type costs 0.1-0.3 ms to make, a protocol as much: the records
    (TensorInfo, DtypeInfo, TensorMeta, CheckpointIndex) are made on their first
    use, and the protocols handles satisfy are for type checkers."""
    out = run_counting_named_tuples(f"""
        import fastst
        f = fastst.safe_open({str(f32_file)!r})
        f.get_tensor("x")
        fastst.load_file({str(f32_file)!r})
        print(made, sorted(name for name in ("fastst._handles.protocols", "fastst._handles.meta",
                                             "fastst._format.index") if name in sys.modules))
        f.info("x"), f.get_tensor_meta("x"), fastst.DTYPES, fastst.read_options()
        print(sorted(made))
    """, imports="import numpy   # which makes named tuples of its own")
    assert out.splitlines() == ["[] []", "['DtypeInfo', 'ReadOptions', 'TensorInfo', 'TensorMeta']"]


def test_the_records_are_one_class_each_however_many_threads_ask():
    out = run_python("""
        import threading
        import fastst._core as core
        found, start = [], threading.Barrier(8)
        def ask():
            start.wait()
            found.append((core.DTYPES[0].__class__, core.TensorInfo, core.WriteSpec))
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(len(set(found)), found[0][0] is core.DtypeInfo)
    """)
    assert out.split() == ["1", "True"]


def test_a_save_of_numpy_dtypes_imports_no_ml_dtypes(tmp_path):
    path = tmp_path / "saved.safetensors"
    assert modules_loaded_by(
        f"import fastst, numpy as np; "
        f"fastst.save_file({{'x': np.ones(2, np.float32), 'm': np.ones(2, bool)}}, {str(path)!r}); "
        f"fastst.save({{'y': np.arange(3)}})", ["ml_dtypes"]) == []


def test_a_bfloat16_array_handed_out_as_numpy_imports_ml_dtypes(wide_file):
    assert modules_loaded_by(
        f"import fastst; array = fastst.load_file({str(wide_file)!r})['b']; "
        f"assert array.dtype.name == 'bfloat16', array.dtype", ["ml_dtypes"]) == ["ml_dtypes"]


@pytest.mark.needs("torch")
def test_bfloat16_and_float8_read_into_torch_import_no_ml_dtypes(wide_file):
    out = run_python(f"""
        import sys, fastst, fastst.torch
        path = {str(wide_file)!r}
        loaded = fastst.torch.load_file(path)
        with open(path, "rb") as file:
            from_bytes = fastst.torch.load(file.read())
        with fastst.safe_open(path, framework="pt", backend="pread") as f:
            rows = f.get_slice("b")[:, 1:]
            read_ahead = dict(f.iter_tensors())
        print("ml_dtypes" in sys.modules)
        print(loaded["b"].float().tolist(), from_bytes["f"].float().tolist())
        print(rows.dtype, rows.float().tolist(), read_ahead["f"].dtype)
    """)
    assert out.splitlines() == [
        "False", "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] [0.0, 1.0, 2.0, 3.0]",
        "torch.bfloat16 [[1.0, 2.0], [4.0, 5.0]] torch.float8_e4m3fn"]


def test_inspecting_files_imports_no_ml_dtypes(wide_file, tmp_path):
    """`fastst inspect` of a file and of a sharded checkpoint, as text and JSON."""
    folder = tmp_path / "sharded"
    fastst.save_file(fastst.load_file(wide_file), folder, max_shard_size=16)
    assert len(list(folder.glob("*.safetensors"))) > 1
    out = run_python(f"""
        import contextlib, io, sys
        from fastst.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            statuses = [main(["inspect", {str(wide_file)!r}, {str(folder)!r}]),
                        main(["inspect", "--json", {str(folder)!r}])]
        print(statuses, "ml_dtypes" in sys.modules)
    """)
    assert out.split() == ["[0,", "0]", "False"]


@pytest.mark.needs("torch")
def test_converting_a_bfloat16_checkpoint_imports_no_ml_dtypes(tmp_path):
    import torch

    source, target = tmp_path / "model.pt", tmp_path / "model.safetensors"
    torch.save({"w": torch.arange(6, dtype=torch.bfloat16)}, source)
    assert modules_loaded_by(
        f"from fastst.convert import torch_to_safetensors; "
        f"torch_to_safetensors({str(source)!r}, {str(target)!r})", ["ml_dtypes"]) == []
    assert fastst.load_file(target)["w"].astype(np.float32).tolist() == [0, 1, 2, 3, 4, 5]


def test_a_dtype_declared_by_its_numpy_name_needs_no_ml_dtypes_imported_first(tmp_path):
    path = tmp_path / "declared.safetensors"
    out = run_python(f"""
        import sys
        from fastst.writer import StreamWriter, declared_specs
        print([spec.dtype for spec in declared_specs({{"b": ("bfloat16", [2]),
                                                       "f": ("float8_e5m2", [1])}})])
        print("ml_dtypes" in sys.modules)
        with StreamWriter({str(path)!r}, {{"b": ("bfloat16", [2])}}) as writer:
            writer.write_bytes("b", bytes([0x80, 0x3f, 0x00, 0x40]))
    """)
    assert out.splitlines() == ["['BF16', 'F8_E5M2']", "False"]
    assert fastst.load_file(path)["b"].astype(np.float32).tolist() == [1.0, 2.0]


def test_a_reader_leaving_ml_dtypes_out_hands_out_the_bits(wide_file):
    reader = Reader()
    reader.uses_ml_dtypes = False
    reader.open_file(wide_file)
    bits = reader.get_tensor("b")
    assert (bits.dtype, reader.get_tensor("f").dtype, reader.get_tensor("i").dtype) == (
        np.dtype("<u2"), np.dtype("u1"), np.dtype("<i4"))
    assert reader.array_dtype("BF16") == np.dtype("<u2")
    reader.uses_ml_dtypes = True
    array = reader.get_tensor("b")
    assert array.dtype == ml_dtypes.bfloat16 and reader.array_dtype("BF16") == array.dtype
    assert bits.tobytes() == array.tobytes()
    assert array.astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(fastst.SafetensorError, match="unknown dtype 'F7'"):
        reader.array_dtype("F7")


@pytest.mark.needs("torch")
def test_a_first_torch_load_imports_nothing_beyond_torch_but_fastst(wide_file):
    out = run_python(f"""
        import sys, torch
        before = set(sys.modules)
        import fastst.torch
        fastst.torch.load_file({str(wide_file)!r})
        print(sorted(name for name in set(sys.modules) - before
                     if not name.startswith(("fastst", "_cython", "cython"))))
    """)
    assert out.strip() == "[]"


@pytest.mark.needs("torch")
def test_a_first_torch_load_imports_no_writer_and_makes_only_the_records_it_uses(wide_file):
    """The low-level functions and checksums are a save's; a load makes DtypeInfo for
    DTYPES (the torch dtypes are read from it) and TensorInfo (a converter is given
    each tensor's), and no other named tuple type."""
    out = run_counting_named_tuples(f"""
        import fastst.torch
        fastst.torch.load_file({str(wide_file)!r})
        print(made, sorted(name for name in ("fastst._format.lowlevel", "fastst._format.checksums")
                           if name in sys.modules))
        from fastst.torch import serialize
        print(serialize is sys.modules["fastst._format.lowlevel"].serialize)
    """, imports="import torch")
    assert out.splitlines() == ["['DtypeInfo', 'TensorInfo'] []", "True"]


def test_inspecting_a_file_imports_neither_the_converter_nor_a_thread_pool(wide_file):
    """Nor json (a file's report is text), the checkpoint module (a file is not one),
    threading, which a first inspect paid for, and argparse, which a plain ``inspect
    FILE`` needs not, nor shutil, which argparse imports to find the terminal's width
    (and shutil three compressors)."""
    out = run_python(f"""
        import contextlib, io, sys
        from fastst.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            status = main(["inspect", {str(wide_file)!r}])
        print(status, sorted(name for name in ("fastst.convert", "zipfile", "concurrent.futures",
                                               "logging", "json", "fastst.checkpoint",
                                               "threading", "shlex", "shutil", "argparse")
                                   if name in sys.modules))
    """)
    assert out.strip() == "0 []"


@pytest.mark.needs("torch")
def test_loading_onto_cuda_opens_the_file_without_ml_dtypes(wide_file):
    """The ring that streams a file onto a CUDA device reads its header and bytes
    only. The device and the ring are stood in for: what is counted is the opening."""
    out = run_python(f"""
        import sys, torch, fastst.torch
        from fastst._frameworks import cuda as _cuda
        fastst.torch._streamed_cuda_device = lambda device, filename: torch.device("cuda", 0)
        opened = []
        def load_all(handle, device):
            opened.append(handle.keys())
            return {{}}
        def load_into(targets, handle, device):
            opened.append(handle.keys())
            return [], {{}}
        _cuda.load_all, _cuda.load_into = load_all, load_into
        fastst.torch.load_file({str(wide_file)!r}, device="cuda")
        fastst.torch.load_model(torch.nn.Module(), {str(wide_file)!r}, strict=False,
                                device="cuda")
        print(opened, "ml_dtypes" in sys.modules)
    """)
    assert out.split() == ["[['b',", "'f',", "'i'],", "['b',", "'f',", "'i']]", "False"]


@pytest.mark.needs("torch")
def test_the_distributed_loaders_read_bfloat16_without_ml_dtypes(wide_file):
    """One rank, in a group of its own."""
    out = run_python(f"""
        import sys, torch, torch.distributed as dist, fastst.distributed as fd
        dist.init_process_group("gloo", init_method="file://{wide_file}.group", rank=0,
                                world_size=1)
        split = fd.load_split({str(wide_file)!r})
        parallel = fd.load_tensor_parallel({str(wide_file)!r}, {{"b": 1}})
        dist.destroy_process_group()
        print("ml_dtypes" in sys.modules)
        print(split["b"].float().tolist(), split["f"].dtype, parallel["b"].float().tolist())
    """)
    assert out.splitlines() == ["False", "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] "
                                         "torch.float8_e4m3fn [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]"]


@pytest.mark.needs("torch")
def test_a_loader_of_torch_batches_reads_bfloat16_without_ml_dtypes(wide_file):
    """Nor does its copy pickled for a worker."""
    out = run_python(f"""
        import pickle, sys
        from fastst._data.loader import Loader
        with Loader({str(wide_file)!r}, "b", 2, framework="pt", threads=1) as loader:
            batches = [batch["b"].float().tolist() for batch in loader]
            copy = pickle.loads(pickle.dumps(loader))
        with copy:
            batches += [batch["b"].float().tolist() for batch in copy]
        print("ml_dtypes" in sys.modules, batches)
    """)
    assert out.strip() == "False " + str([[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]] * 2)


@pytest.mark.needs("torch")
def test_prefetching_bfloat16_into_torch_imports_no_ml_dtypes(wide_file):
    out = run_python(f"""
        import sys, fastst
        with fastst.safe_open({str(wide_file)!r}, framework="pt") as f:
            with f.prefetch({{"b": slice(1, 2), "f": None}}) as loader:
                tensors = dict(loader)
        print("ml_dtypes" in sys.modules)
        print(tensors["b"].float().tolist(), tensors["f"].float().tolist())
    """)
    assert out.splitlines() == ["False", "[[3.0, 4.0, 5.0]] [0.0, 1.0, 2.0, 3.0]"]


@pytest.mark.needs("torch")
def test_verifying_a_bfloat16_conversion_against_torch_imports_no_ml_dtypes(tmp_path):
    import torch

    source, target = tmp_path / "model.pt", tmp_path / "model.safetensors"
    torch.save({"w": torch.arange(6, dtype=torch.bfloat16)}, source)
    assert modules_loaded_by(
        f"from fastst.convert import torch_to_safetensors; "
        f"torch_to_safetensors({str(source)!r}, {str(target)!r}, verify_torch=True)",
        ["ml_dtypes"]) == []


@pytest.mark.needs("torch")
def test_writing_pieces_of_bfloat16_torch_tensors_imports_no_ml_dtypes(tmp_path):
    """Through the writer and through a region of its file; a piece of another dtype
    is still refused, by its dtype's name."""
    path = tmp_path / "pieces.safetensors"
    out = run_python(f"""
        import sys, torch
        from fastst import SafetensorTypeError
        from fastst.writer import StreamWriter
        rows = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
        declared = {{"b": (torch.bfloat16, [3, 2]), "f": ("F8_E4M3", [4]), "h": ("F16", [2])}}
        with StreamWriter({str(path)!r}, declared) as writer:
            writer.write("b", rows[:1])
            region = writer.region("b")
            region.write(rows[1:2], 1)
            region[2:3] = rows[2:]
            writer.write("f", torch.arange(4).to(torch.float8_e4m3fn))
            for piece, write in [(rows[0], lambda piece: writer.write("h", piece)),
                                 (torch.ones(2), lambda piece: region.write(piece[None], 0))]:
                try:
                    write(piece)
                except SafetensorTypeError as error:
                    print(error)
            writer.write("h", torch.ones(2, dtype=torch.float16))
        print("ml_dtypes" in sys.modules)
    """)
    assert out.splitlines() == [
        f"{path}: tensor 'h' is F16: its pieces must be float16 arrays, got bfloat16",
        f"{path}: tensor 'b' is BF16: its pieces must be bfloat16 arrays, got float32 at row 0",
        "False"]
    loaded = fastst.load_file(path)
    assert loaded["b"].astype(np.float32).tolist() == [[0, 1], [2, 3], [4, 5]]
    assert loaded["f"].astype(np.float32).tolist() == [0, 1, 2, 3]


def test_a_first_load_imports_what_slices_reads_ahead_or_opens_checkpoints_on_their_use(
        f32_file):
    assert modules_loaded_by(
        f"import fastst; fastst.load_file({str(f32_file)!r})",
        ["threading", "fastst._handles.slicing", "fastst._format.blocks",
         "fastst._handles.readahead", "fastst.checkpoint"]) == []


def test_the_numpy_face_loads_without_the_low_level_functions_it_re_exports(f32_file):
    """``safetensors.numpy`` re-exports serialize, deserialize...: through the switch,
    libraries import them from fastst.numpy, which imports them on their first use."""
    out = run_python(f"""
        import sys
        from fastst.numpy import load_file
        load_file({str(f32_file)!r})
        print(sorted(name for name in ("fastst._format.lowlevel", "fastst._format.checksums",
                                       "fastst._format.torch_dtypes") if name in sys.modules))
        from fastst.numpy import serialize
        print(serialize is sys.modules["fastst._format.lowlevel"].serialize)
    """)
    assert out.splitlines() == ["[]", "True"]


def test_reads_and_writes_load_the_format_core_alone(f32_file, tmp_path):
    """The loader's ring is the core's second extension: loaded by a Loader (or the
    first of its names used), never by opening, reading, slicing or writing a file."""
    copy = str(tmp_path / "copy.safetensors")
    assert modules_loaded_by(
        f"import fastst; t = fastst.load_file({str(f32_file)!r}); "
        f"fastst.save_file(t, {copy!r}); f = fastst.safe_open({copy!r}); f.get_slice('x')[1:]",
        ["fastst._core._ring"]) == []
    assert modules_loaded_by("from fastst._core import BatchRing",
                             ["fastst._core._ring"]) == ["fastst._core._ring"]


def test_a_first_load_compiles_no_regular_expression(f32_file):
    """Each costs a compile in the first process to use it: those of URLs, shard
    names, digests and NumPy's index errors wait for their use. (NumPy's own, which
    the reference pays too, are compiled before counting.)"""
    out = run_python(f"""
        import re, numpy
        compiled, compile = [], re._compile
        def counted(pattern, flags):
            if (type(pattern), pattern, flags) not in re._cache:
                compiled.append(pattern)
            return compile(pattern, flags)
        re._compile = counted
        import fastst
        fastst.load_file({str(f32_file)!r})
        print(compiled)
    """)
    assert out.strip() == "[]"


@pytest.mark.needs("torch")
def test_a_first_torch_load_imports_what_slices_reads_ahead_or_opens_checkpoints_on_their_use(
        wide_file):
    assert modules_loaded_by(
        f"import fastst.torch; fastst.torch.load_file({str(wide_file)!r})",
        ["fastst._handles.slicing", "fastst._format.blocks", "fastst._handles.readahead", "fastst.checkpoint",
         "fastst._io.progress"]) == []


def test_a_command_builds_its_own_arguments_alone(wide_file):
    """A run with options builds the parser of its command alone: the whole command
    line's, every command's arguments in it, only for ``fastst --help`` or a usage
    error."""
    out = run_python(f"""
        import argparse, contextlib, io
        added, add_argument = set(), argparse.ArgumentParser.add_argument
        def counted(parser, *args, **kwargs):
            action = add_argument(parser, *args, **kwargs)
            added.add(action.dest)
            return action
        argparse.ArgumentParser.add_argument = counted
        from fastst.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            main(["inspect", "--json", {str(wide_file)!r}])
        print(sorted(added))
    """)
    assert out.strip() == "['files', 'help', 'json', 'max_header_size']"


def test_a_usage_error_is_told_by_the_whole_command_line(capsys, wide_file):
    from fastst.cli import main

    assert main(["inspect", str(wide_file), "--bogus"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "fastst: error: unrecognized arguments: --bogus")
