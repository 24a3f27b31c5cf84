"""Build the compiled core, and put the switch's .pth file at the root of the wheel.
FASTST_DEBUG=1 turns Cython's bounds checks back on."""
import os
import sysconfig

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# Read by Python as it starts, from beside the installed package: it turns the switch
# on when FASTST_PATCH_SAFETENSORS=1 (fastst.patch_safetensors).
SWITCH = "fastst-safetensors.pth"

DEBUG = os.environ.get("FASTST_DEBUG") == "1"

# NumPy 2: the core allows NumPy 2's 64 dimensions (NumPy 1 has 32). orjson 3.9.15: the
# first to bound the nesting of what it parses (3.9.14 crashes on a hostile header).
# Not on a free-threaded Python: orjson has no wheel for it, and turns the GIL back on
# when imported there; fastst decodes with the standard library instead (fastst/_json.py).
# No environment marker tells the two builds apart, and a wheel's metadata is its build's.
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
DEPENDENCIES = ["numpy>=2.0", "ml_dtypes>=0.5"] + ([] if FREE_THREADED else ["orjson>=3.9.15"])

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
    "freethreading_compatible": True,
}

CORE = os.path.join("fastst", "_core")
# Everything a build of the core reads; listed here, it also goes into the sdist.
SOURCES = [os.path.join(CORE, name) for name in sorted(os.listdir(CORE))
           if name.endswith((".pyx", ".pxd", ".pxi", ".h"))]
# NumPy 2.0's C API, which the runtime requires: the allocation handler functions
# (PyDataMem_SetHandler) are not declared for a target older than NumPy 1.22, which
# the headers of some NumPy 2 releases take by default.
NUMPY_API = [("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION"),
             ("NPY_TARGET_VERSION", "NPY_2_0_API_VERSION")]
# No debug information in a release build: a quarter of the compiler's time, and
# three quarters of the module's size, for symbols a user never reads.
COMPILE_ARGS = ["-O0", "-g"] if DEBUG else ["-O3", "-g0"]


def core_extension(name: str, source: str, *flags: str) -> Extension:
    return Extension(name, [os.path.join(CORE, source)], depends=SOURCES,
                     include_dirs=[numpy.get_include()], define_macros=NUMPY_API,
                     extra_compile_args=COMPILE_ARGS + list(flags))


# Two extensions: the format core (fastst._core: headers, reads, writes), which a read
# loads alone, and the thread Loader's ring (fastst._core._ring), which takes what it
# needs of the first through _core/__init__.pxd.
extensions = cythonize([core_extension("fastst._core", "__init__.pyx"),
                        # the ring uses a few of the core's kernels, not all
                        core_extension("fastst._core._ring", "_ring.pyx",
                                       "-Wno-unused-function")],
                       compiler_directives=directives)
# cythonize adds NumPy's headers to what the core depends on, by absolute paths: not
# files of the sdist (setuptools warns about each), and the build finds them anyway.
for built in extensions:
    built.depends = [path for path in built.depends if not os.path.isabs(path)]


class build_py_with_switch(build_py):
    """build_py, which also puts the switch's .pth file at the root of the wheel, where
    pip installs it beside the package (and `pip uninstall` removes it)."""

    def run(self):
        super().run()
        self.copy_file(SWITCH, self.switch_target(), preserve_mode=False)

    def switch_target(self):
        # An editable wheel holds what `install` puts in its folder, and none of
        # build_lib: the package stays in the checkout.
        root = (self.get_finalized_command("install").install_lib if self.editable_mode
                else self.build_lib)
        return os.path.join(root, SWITCH)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, self.switch_target()]


# Imported rather than run (`nox -s macos`), it generates the core's C and stops there.
if __name__ == "__main__":
    setup(ext_modules=extensions, install_requires=DEPENDENCIES,
          cmdclass={"build_py": build_py_with_switch})
