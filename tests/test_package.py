"""The public names that users import, and the packaging that installs them."""

import subprocess
import sys
from pathlib import Path

import pytest

import kvmem
from kvmem import kernels

ROOT = Path(__file__).resolve().parents[1]


def test_kvmem_exports_resolve_to_their_modules():
    for name in kvmem.__all__:
        obj = getattr(kvmem, name)
        assert obj.__module__.startswith("kvmem."), (name, obj.__module__)


def test_kernels_exports_are_the_kernel_functions():
    for name in kernels.__all__:
        assert callable(getattr(kernels, name)), name
        assert getattr(kernels, name).__module__.startswith("kvmem.kernels."), name


def test_every_package_folder_is_installed():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent.relative_to(ROOT / "kvmem") for p in (ROOT / "kvmem").rglob("__init__.py")}
    want = {"kvmem" if f == Path(".") else "kvmem." + ".".join(f.parts) for f in folders} | {"kvmem.kernels"}
    assert set(config["packages"]) == want
    assert config["package-dir"]["kvmem.kernels"] == "kernels"


def test_kvmem_kernels_live_beside_hugging_face_kernels(tmp_path):
    # From another folder, as an application imports them: the repository root (which holds kvmem's
    # kernels/ sources) is not on sys.path there.
    code = ("import importlib.util, sys\n"
            "if importlib.util.find_spec('kernels') is None: sys.exit(77)\n"
            "import kernels, kvmem.kernels\n"
            "assert hasattr(kernels, 'get_kernel'), kernels.__file__\n"
            "assert kvmem.kernels.create_kv_indices.__module__ == 'kvmem.kernels.kv_indices'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    if proc.returncode == 77:
        pytest.skip("Hugging Face's kernels package is not installed (CI installs it)")
    assert proc.returncode == 0, proc.stderr
