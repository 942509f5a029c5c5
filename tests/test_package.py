"""The public names that users import from the two packages."""

from kvmem import kernels
import kvmem


def test_kvmem_exports_resolve():
    for name in kvmem.__all__:
        assert getattr(kvmem, name) is not None, name


def test_kernels_exports_resolve():
    for name in kernels.__all__:
        assert callable(getattr(kernels, name)), name
