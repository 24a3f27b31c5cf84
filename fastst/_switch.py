"""The switch that serves fastst under the reference's names, for the libraries that
import ``safetensors`` themselves (transformers, diffusers, accelerate...).

A finder first on ``sys.meta_path`` answers every ``safetensors`` module name: each
of ``FACES`` is a module of its own that shows the fastst module it stands for (its
names are fastst's objects, looked up on use), and any other name is refused with
an error that says what is served. The reference, installed or not, is never
imported; ``importlib.metadata`` still describes the installed distribution.

Thrown from the environment, the switch is installed as Python starts, by the
package's ``.pth`` file: it then imports only this module and the package's own
light ``__init__``, and the finder the rest of its needs when ``safetensors`` is
first imported.
"""
import os
import sys

TYPE_CHECKING = False   # typing's flag, without importing typing as Python starts
if TYPE_CHECKING:
    import importlib.machinery
    import types
    from typing import Any, Dict, List, Optional, Sequence

# The reference's release whose API fastst offers, as `safetensors.__version__` gives
# it under the switch: libraries choose their code paths by it (huggingface_hub
# loads onto a device itself only from 0.4.3 on).
REFERENCE_VERSION = "0.8.0"

# what `import safetensors...` gives under the switch -> the fastst module it shows
FACES = {"safetensors": "fastst", "safetensors.numpy": "fastst.numpy",
         "safetensors.torch": "fastst.torch", "safetensors.flax": "fastst.flax"}

ENVIRONMENT_VARIABLE = "FASTST_PATCH_SAFETENSORS"


class SafetensorsFinder:
    """The finder and loader of the ``safetensors`` modules under the switch: a meta
    path finder and a loader as the import system calls them (``importlib.abc``'s
    methods, without its import, which costs milliseconds as Python starts)."""

    def find_spec(self, fullname: str, path: "Optional[Sequence[str]]" = None,
                  target: "Optional[types.ModuleType]" = None
                  ) -> "Optional[importlib.machinery.ModuleSpec]":
        if fullname != "safetensors" and not fullname.startswith("safetensors."):
            return None
        import importlib.machinery
        import importlib.util

        if fullname not in FACES:
            served = ", ".join(FACES)
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: fastst serves safetensors "
                f"({ENVIRONMENT_VARIABLE}=1 or fastst.patch_safetensors()) and has "
                f"{served}; fastst.safe_open(path, framework=...) reads for MLX, "
                f"TensorFlow and Paddle", name=fullname)
        face = importlib.util.find_spec(FACES[fullname])
        assert face is not None and face.origin is not None   # fastst's own modules
        # the finder loads the module too: a Loader by its methods, not importlib.abc's class
        spec = importlib.machinery.ModuleSpec(
            fullname, self, origin=face.origin,  # type: ignore[arg-type]
            is_package=fullname == "safetensors")
        spec.has_location = True    # __file__: the fastst module's file
        if fullname == "safetensors":
            spec.submodule_search_locations = []    # its submodules come from here alone
        return spec

    def create_module(self, spec: "importlib.machinery.ModuleSpec") -> None:
        return None     # a new module, as for any other

    def exec_module(self, module: "types.ModuleType") -> None:
        import importlib

        show(module, importlib.import_module(FACES[module.__name__]))


def show(module: "types.ModuleType", face: "types.ModuleType") -> None:
    """Make `module` show every name of `face`, looked up there on use: fastst's
    objects themselves, and its lazy names still loaded on first use."""
    own = module.__name__

    def __getattr__(name: str) -> "Any":
        # a submodule is an attribute only once imported, as in any package
        if f"{own}.{name}" in FACES or not hasattr(face, name):
            raise AttributeError(f"module {own!r} has no attribute {name!r}")
        return getattr(face, name)

    def __dir__() -> "List[str]":
        return sorted(set(vars(module)) | set(dir(face)))

    shown: Dict[str, Any] = {"__doc__": face.__doc__, "__getattr__": __getattr__,
                             "__dir__": __dir__}
    if hasattr(face, "__all__"):
        shown["__all__"] = list(face.__all__)
    if own == "safetensors":
        shown["__version__"] = REFERENCE_VERSION
    vars(module).update(shown)


FINDER = SafetensorsFinder()


def patch_safetensors() -> None:
    """Serve fastst wherever ``safetensors`` is imported from now on, in this process.

    Afterwards ``import safetensors``, ``safetensors.numpy``, ``safetensors.torch``
    and ``safetensors.flax`` give modules that show fastst's (``safetensors.__file__``
    is fastst's), whether or not the reference is installed; ``safetensors.__version__``
    is the release of the reference whose API fastst offers, and the other modules
    of the reference (``safetensors.mlx``...) raise ``ModuleNotFoundError``. Call it
    before importing the libraries that import ``safetensors`` (transformers,
    diffusers, accelerate...), or set ``FASTST_PATCH_SAFETENSORS=1`` in the
    environment, which calls it as Python starts. A second call does nothing.

    Raises
    ------
    RuntimeError
        When a ``safetensors`` module is imported already: whatever imported it
        keeps the reference's functions, so nothing is changed.

    Examples
    --------
    In a new Python, before anything imports ``safetensors``:

    >>> import subprocess, sys
    >>> code = '''
    ... import fastst
    ... fastst.patch_safetensors()
    ... import safetensors, safetensors.numpy
    ... print(safetensors.__version__, safetensors.numpy.load_file is fastst.load_file)
    ... '''
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
    ...                check=True).stdout
    '0.8.0 True\\n'
    """
    if FINDER in sys.meta_path:
        return
    imported = sorted(name for name, module in list(sys.modules.items())
                      if (name == "safetensors" or name.startswith("safetensors."))
                      and module is not None)
    if imported:
        raise RuntimeError(
            f"safetensors is imported already ({', '.join(imported)}): what imported it "
            f"keeps the reference's functions. Call fastst.patch_safetensors() before "
            f"importing the libraries that use safetensors, or set "
            f"{ENVIRONMENT_VARIABLE}=1 in the environment to serve fastst from the start")
    sys.meta_path.insert(0, FINDER)


def patch_from_environment() -> None:
    """What the package's ``.pth`` file calls as Python starts, when
    ``FASTST_PATCH_SAFETENSORS`` is set to anything but 0."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if value == "1":
        patch_safetensors()
    elif value not in ("", "0"):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: set it to 1 to serve fastst "
                         f"as safetensors, or to 0 (or unset it) to leave safetensors alone")
