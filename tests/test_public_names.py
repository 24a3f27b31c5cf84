"""Every name users and the docs import stays where they import it from, and every
public class says which module that is: moving the private code beneath (its folders,
its files) changes neither. A class defined in a private module names the public
module that offers it, as ``numpy.ndarray`` says ``numpy``: its repr, its pickles and
the docs then never show a private path that a later move would break."""
import importlib
import pickle

import pytest

# The modules users import, and the names each offers (its __all__).
PUBLIC_NAMES = {
    "fastst": [
        "DEFAULT_MAX_HEADER_SIZE", "DTYPES", "DTYPE_CODES", "DtypeInfo", "FrameworkHandle",
        "NumpyHandle", "PrefetchLoader", "SafeSlice", "SafetensorError", "SafetensorIndexError",
        "SafetensorNotImplementedError", "SafetensorTypeError", "StreamWriter", "TensorInfo",
        "TensorMeta", "TensorNotFoundError", "TensorSpec", "__version__", "deserialize", "load",
        "load_file", "load_into", "load_state", "numpy", "patch_safetensors", "read_options",
        "safe_open", "save", "save_file", "save_file_from", "save_state", "serialize",
        "serialize_file", "update_metadata", "writer"],
    "fastst.numpy": [
        "TensorSpec", "deserialize", "load", "load_file", "safe_open", "save", "save_file",
        "serialize", "serialize_file"],
    "fastst.torch": [
        "TORCH_DTYPES", "TensorSpec", "converter", "deserialize", "load", "load_file",
        "load_model", "safe_open", "save", "save_file", "save_model", "serialize",
        "serialize_file", "spec_of_tensor", "storage_ptr", "storage_size"],
    "fastst.flax": ["load", "load_file", "save", "save_file"],
    "fastst.jax": ["converter", "from_torch"],
    "fastst.remote": [
        "CONNECT_TIMEOUT", "FileObjectRanges", "MAX_REQUESTS", "MAX_WHOLE_READ", "PART_SIZE",
        "Pace", "READ_TIMEOUT", "START_REQUESTS", "SpooledUpload", "UrlRanges", "open_object",
        "read_object", "save_plan", "with_default_timeouts"],
    "fastst.checkpoint": [
        "CheckpointIndex", "DEFAULT_PATTERN", "INDEX_SUFFIX", "NumpyShardedHandle", "ShardEntry",
        "ShardedHandle", "data_bytes", "is_checkpoint", "is_checkpoint_path", "open_checkpoint",
        "parse_size", "read_index", "save_checkpoint", "split_into_shards"],
    "fastst.integrity": [
        "ALGORITHMS", "CHECKSUM_KEY", "VerifyingHandle", "checksum_metadata", "checksums_of",
        "digest_of", "digests_in_file", "digests_of", "plan_with_checksums", "report_lines",
        "reserved_checksums", "verify_file", "verify_path", "with_checksums"],
    "fastst.writer": [
        "MAX_ALIGN", "PendingFile", "StreamWriter", "TensorRegion", "TensorSpec", "WritePlan",
        "WriteSpec", "declared_specs", "deserialize", "plan_write", "save_file_from",
        "serialize", "serialize_file", "spec_of_array", "specs_of", "update_metadata",
        "write_atomically"],
    "fastst.state": [
        "MAX_DEPTH", "STATE_KEY", "STATE_VERSION", "load_state", "save_state",
        "state_from_tensors", "state_to_tensors", "tensor_specs"],
    "fastst.data": ["Loader", "Rows", "batch_sampler", "batches", "data_loader"],
    "fastst.dask": ["from_safetensors", "open_files_kept", "to_safetensors"],
    "fastst.distributed": [
        "Read", "ReadPlan", "load_split", "load_tensor_parallel", "plan_shardings",
        "plan_split", "plan_tensor_parallel"],
    "fastst.convert": [
        "ConversionReport", "DEFAULT_MAX_EXPANSION", "convert", "convert_directory",
        "is_torch_checkpoint", "numpy_to_safetensors", "safetensors_name",
        "torch_to_safetensors"],
}

# Each public class, as "module.Name" where users find it, and the __module__ it says.
CLASS_MODULES = {
    "fastst.DtypeInfo": "fastst",
    "fastst.TensorInfo": "fastst",
    "fastst.FrameworkHandle": "fastst",
    "fastst.NumpyHandle": "fastst",
    "fastst.TensorMeta": "fastst",
    "fastst.PrefetchLoader": "fastst",
    "fastst.SafeSlice": "fastst",
    "fastst.TensorSpec": "fastst",
    "fastst.safe_open": "fastst._api",
    "fastst.SafetensorError": "fastst._core",
    "fastst.SafetensorIndexError": "fastst._core",
    "fastst.SafetensorNotImplementedError": "fastst._core",
    "fastst.SafetensorTypeError": "fastst._core",
    "fastst.TensorNotFoundError": "fastst._core",
    "fastst.StreamWriter": "fastst.writer",
    "fastst.remote.FileObjectRanges": "fastst.remote",
    "fastst.remote.Pace": "fastst.remote",
    "fastst.remote.SpooledUpload": "fastst.remote",
    "fastst.remote.UrlRanges": "fastst.remote",
    "fastst.checkpoint.CheckpointIndex": "fastst.checkpoint",
    "fastst.checkpoint.NumpyShardedHandle": "fastst.checkpoint",
    "fastst.checkpoint.ShardEntry": "fastst.checkpoint",
    "fastst.checkpoint.ShardedHandle": "fastst.checkpoint",
    "fastst.integrity.VerifyingHandle": "fastst.integrity",
    "fastst.writer.PendingFile": "fastst.writer",
    "fastst.writer.TensorRegion": "fastst.writer",
    "fastst.writer.WritePlan": "fastst._core",
    "fastst.writer.WriteSpec": "fastst.writer",
    "fastst.data.Loader": "fastst.data",
    "fastst.data.Rows": "fastst.data",
    "fastst.distributed.Read": "fastst.distributed",
    "fastst.distributed.ReadPlan": "fastst.distributed",
    "fastst.convert.ConversionReport": "fastst.convert",
}

OPTIONAL = {"fastst.torch": "torch", "fastst.flax": "jax", "fastst.jax": "jax",
            "fastst.dask": "dask", "fastst.distributed": None}


def public_module(name):
    needs = OPTIONAL.get(name)
    if needs:
        pytest.importorskip(needs)
    return importlib.import_module(name)


def found(path):
    module_name, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module_name), name)


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_each_public_module_offers_the_names_it_always_offered(module_name):
    module = public_module(module_name)
    assert sorted(module.__all__) == PUBLIC_NAMES[module_name]
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


@pytest.mark.parametrize("path", sorted(CLASS_MODULES))
def test_each_public_class_names_the_module_it_always_named(path):
    cls = found(path)
    assert isinstance(cls, type)
    assert cls.__module__ == CLASS_MODULES[path]
    assert getattr(importlib.import_module(cls.__module__), cls.__qualname__) is cls


def test_every_public_class_is_listed():
    listed = {found(path) for path in CLASS_MODULES}
    unlisted = [f"{module_name}.{name}"
                for module_name in PUBLIC_NAMES if module_name not in OPTIONAL
                for name in PUBLIC_NAMES[module_name]
                if isinstance(getattr(importlib.import_module(module_name), name), type)
                and getattr(importlib.import_module(module_name), name) not in listed]
    assert unlisted == []


@pytest.mark.parametrize("path", ["fastst.TensorMeta", "fastst.checkpoint.CheckpointIndex",
                                  "fastst.remote.Pace"])
def test_a_public_class_pickles_by_its_public_name(path):
    cls = found(path)
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert path.encode() in pickle.dumps(cls, protocol=0).replace(b"\n", b".")
