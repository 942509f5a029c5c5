"""The build of kvmem's compiled replay engine, `kvmem.replay._native` (C++ in kvmem/replay/native/, bound with
pybind11); everything else is in pyproject.toml. The extension is optional: where the compiler fails, kvmem still
installs and `kvmem-replay` runs its Python engine, saying so in one line."""

from setuptools import Extension, setup

try:
    import pybind11
    from pybind11.setup_helpers import ParallelCompile
except ImportError:  # only a build without build isolation can lack it (it is in build-system.requires)
    pybind11 = None
else:
    # The sources compile side by side (one job per core): the binding, pybind11's templates, takes most of it.
    ParallelCompile("KVMEM_BUILD_JOBS").install()

SOURCES = ["tokens.cpp", "tree.cpp", "host_tier.cpp", "storage_tier.cpp", "store.cpp", "replica.cpp", "decode_run.cpp",
           "view.cpp", "cluster.cpp", "bindings.cpp"]

native = Extension(
    "kvmem.replay._native",
    sources=[f"kvmem/replay/native/{name}" for name in SOURCES],
    depends=[f"kvmem/replay/native/{name}" for name in ("events.h", "tokens.h", "tree.h", "store.h", "view.h",
                                                          "replica.h", "driver.h", "cluster.h")],
    include_dirs=[] if pybind11 is None else [pybind11.get_include()],
    language="c++",
    # -ffp-contract=off: no fused multiply-adds, so that the clocks' doubles round as Python's do. -g0: no debug
    # information (Python's -g), a third of the compile time of pybind11's templates.
    extra_compile_args=["-std=c++17", "-O2", "-g0", "-ffp-contract=off", "-fvisibility=hidden"],
    optional=True,
)

setup(ext_modules=[] if pybind11 is None else [native])
