"""Level 1: the req_to_token table, one row per running request.

`req_to_token[row, pos]` is the KV slot (`out_cache_loc`) that holds token `pos` of the request that owns
`row`. Rows are handed out by `alloc` and returned by `free`; the table itself is never resized.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvmem._checks import check_host_bytes, check_int
from kvmem._device import check_device

_SLOT_BOUND = 1 << 31  # the table holds int32 slots


class ReqToTokenPool:
    """A fixed table of `size` rows x `max_context_len` int32 slot ids.

    Args:
        size: number of rows (concurrent requests), > 0.
        max_context_len: longest request in tokens (prompt + output), > 0.
        device: where the table lives (the attention kernels read it there).
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        size = check_int("size", size, minimum=1)
        max_context_len = check_int("max_context_len", max_context_len, minimum=1)
        self.device = check_device(device)
        check_host_bytes(f"a req_to_token table of {size} x {max_context_len}", size * max_context_len * 4)
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        # The same memory as a numpy array when the table is on the host (None on a GPU): the scheduler's
        # small gathers and scatters cost a few us less through numpy than through torch's dispatch.
        self.host_view: np.ndarray | None = self.req_to_token.numpy() if self.device.type == "cpu" else None
        # A stack of free rows: pop from the end so that recently freed (cache-warm) rows are reused first.
        self._free_rows: list[int] = list(range(size - 1, -1, -1))
        self._is_free = [True] * size

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Hands out `n` rows, or returns None (nothing changed) when fewer than `n` are free."""
        check_int("n", n, minimum=1)
        if n > len(self._free_rows):
            return None
        rows = self._free_rows[-n:][::-1]
        del self._free_rows[-n:]
        for r in rows:
            self._is_free[r] = False
        return rows

    def free(self, index: int | Sequence[int] | torch.Tensor) -> None:
        """Returns one row or several rows. A free, repeated or out-of-range row raises; nothing changes."""
        rows = self._as_rows(index)
        bad = [r for r in rows if not 0 <= r < self.size]
        if bad:
            raise IndexError(f"index {bad[0]} out of range [0, {self.size})")
        if len(set(rows)) != len(rows):
            raise ValueError(f"index holds repeated rows: {rows}")
        freed = [r for r in rows if self._is_free[r]]
        if freed:
            raise ValueError(f"index {freed[0]}: row is already free (double free)")
        for r in rows:
            self._is_free[r] = True
        self._free_rows.extend(reversed(rows))

    def _free_row(self, row: int) -> None:
        """free's body for one row its owner knows is allocated (the radix cache, for a Scheduler's request)."""
        self._is_free[row] = True
        self._free_rows.append(row)

    def write(self, index, values) -> None:
        """`req_to_token[index] = values`, with `index` a row, a (row, slice) pair or any tensor index.

        Rows must be allocated; values are slots in [0, 2**31) (checked on the host: a larger one would wrap
        in the int32 table), cast to int32, and must have the shape of the indexed part.
        """
        row = index[0] if isinstance(index, tuple) and index else index
        for r in self._as_rows(row):
            if not 0 <= r < self.size or self._is_free[r]:
                raise IndexError(f"index: row {r} is not an allocated row")
        values = _as_slot_values(values)
        try:
            self.req_to_token[index] = values
        except IndexError as e:
            raise IndexError(f"index {index!r} does not address req_to_token: {str(e).splitlines()[0]}") from None
        except TypeError as e:
            raise TypeError(f"index {index!r} does not address req_to_token: {str(e).splitlines()[0]}") from None
        except RuntimeError as e:
            raise ValueError(f"values do not fit req_to_token[index]: {str(e).splitlines()[0]}") from None

    def clear(self) -> None:
        """Frees every row."""
        self._free_rows = list(range(self.size - 1, -1, -1))
        self._is_free = [True] * self.size

    @staticmethod
    def _as_rows(index) -> list[int]:
        if isinstance(index, torch.Tensor):
            if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
                raise TypeError(f"index must hold integers, got dtype {index.dtype}")
            if index.device.type == "meta":
                raise ValueError("index is on the 'meta' device, which holds no values")
            return [int(i) for i in index.reshape(-1).tolist()]
        if isinstance(index, int) and not isinstance(index, bool):
            return [index]
        if isinstance(index, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in index):
            return list(index)
        raise TypeError(f"index must be an int, a sequence of ints or an integer tensor, got {index!r}")


def _as_slot_values(values) -> torch.Tensor:
    """Slot values as an int32 tensor, refused (naming `values`) when a host value lies outside [0, 2**31)."""
    if not isinstance(values, torch.Tensor):
        arr = np.asarray(values)
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"values must hold integer slots, got dtype {arr.dtype}")
        values = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64)) if arr.size else torch.empty(0)
    elif values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise TypeError(f"values must hold integer slots, got dtype {values.dtype}")
    elif values.device.type == "meta":
        raise ValueError("values are on the 'meta' device, which holds no values")
    if values.numel() and not values.is_cuda:  # on CUDA the check would sync the host
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= _SLOT_BOUND:
            raise ValueError(f"values hold slot {low if low < 0 else high}, outside [0, 2**31) of the int32 table")
    return values.to(torch.int32)
