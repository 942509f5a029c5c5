"""Argument checks at kvmem's public boundary. Torch-free, so that `kvmem.sizing` and the replay's command
line can use them before torch is imported.

Public functions check what a caller hands them, once, where it enters; the internal paths behind them
(ScheduleBatch -> allocator -> kernels -> metadata builders) call unchecked private bodies.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os

import numpy as np


class NotAnIntError(TypeError, ValueError):
    """An integer argument that is not an int (a float, a bool, a string...).

    Both a TypeError (what it is) and a ValueError (what kvmem has always raised for a bad count, and what
    callers catch), as numpy's AxisError is both a ValueError and an IndexError.
    """


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as a Python int, or raises naming `name`: NotAnIntError unless it is an int or numpy integer
    (bool is not), ValueError below `minimum` or above `maximum`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise NotAnIntError(f"{name} must be {_int_kind(minimum, maximum)}, got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {_int_kind(minimum, maximum)}, got {value!r}")
    return value


def check_number(name: str, value, minimum: float | None = None, *, allow_minimum: bool = True) -> float:
    """A finite real number (not a bool) as a float, at least `minimum` (or above it when not
    `allow_minimum`); raises ValueError naming `name`."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and np.isfinite(value)
    if ok and minimum is not None:
        ok = value >= minimum if allow_minimum else value > minimum
    if not ok:
        bound = "" if minimum is None else f" {'>=' if allow_minimum else '>'} {minimum}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def check_host_bytes(what: str, nbytes: int) -> None:
    """Refuses a request for more host memory than this machine has (its physical RAM), with a one-line
    ValueError, rather than failing inside numpy or torch with a MemoryError after minutes of work."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): nothing to compare with
        return
    if nbytes > total:
        raise ValueError(f"{what} needs {nbytes / 2**30:,.1f} GiB of host memory; this machine has "
                         f"{total / 2**30:,.1f} GiB")


def fail_invariant(message: str) -> None:
    """Raises AssertionError naming a broken invariant of the radix cache (what `check_invariants` reports)."""
    raise AssertionError(f"RadixCache invariant broken: {message}")


def _int_kind(minimum: int | None, maximum: int | None) -> str:
    if maximum is not None:
        return f"{_int_kind(minimum, None)} (at most {maximum})"
    if minimum == 1:
        return "a positive int"
    if minimum == 0:
        return "a non-negative int"
    if minimum is not None:
        return f"an int >= {minimum}"
    return "an int"


def _number_arg(kind: type, accepts, wording: str):
    """An argparse type: a `kind` that `accepts` takes; argparse names the option in its error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {wording}, got {text!r}")
        return value
    return parse


positive_int_arg = _number_arg(int, lambda v: v > 0, "a positive int")
non_negative_int_arg = _number_arg(int, lambda v: v >= 0, "a non-negative int")
positive_float_arg = _number_arg(float, lambda v: 0 < v < math.inf, "a positive number")
non_negative_float_arg = _number_arg(float, lambda v: 0 <= v < math.inf, "a non-negative number")
fraction_arg = _number_arg(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def output_file_arg(text: str) -> str:
    """An argparse type for a file a script writes once its work is done: refused at once when it could not be
    written then (a folder by that name, its folder missing, or no write permission)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        reason = "it is a folder"
    elif not os.path.isdir(folder):
        reason = "its folder does not exist"
    elif not os.access(text if os.path.exists(text) else folder, os.W_OK):
        reason = "it is not writable"
    else:
        return text
    raise argparse.ArgumentTypeError(f"cannot write {text!r}: {reason}")
