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


def test_kvmem_kernels_live_beside_a_top_level_kernels_package(tmp_path):
    # Hugging Face's `kernels` (which transformers imports) is a top-level package; kvmem's Triton kernels must
    # not take that name. In a fresh interpreter started from another folder (as an application imports them:
    # the repository root, which holds kvmem's kernels/ sources, is not on sys.path there), no `kernels` comes
    # from kvmem, and a stand-in of Hugging Face's imports beside kvmem.kernels.
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("def get_kernel(name):\n    return name\n")
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.find_spec('kernels')\n"
            f"assert spec is None or not spec.origin.startswith({str(ROOT / 'kernels')!r}), spec.origin\n"
            f"sys.path.insert(0, {str(site)!r})\n"
            "import kernels, kvmem.kernels\n"
            "assert kernels.get_kernel('x') == 'x', kernels.__file__\n"
            "assert kvmem.kernels.create_kv_indices.__module__ == 'kvmem.kernels.kv_indices'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
