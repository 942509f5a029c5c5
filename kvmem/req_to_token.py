"""Level 1: the req_to_token table, one row per running request.

`req_to_token[row, pos]` is the KV slot (`out_cache_loc`) that holds token `pos` of the request that owns
`row`. Rows are handed out by `alloc` and returned by `free`; the table itself is never resized.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvmem._checks import check_host_bytes, check_int
from kvmem._device import check_device
from kvmem._torch import torch

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
        # The same memory as a numpy array when the table is on the host (None on a GPU): the trusted accessors'
        # small gathers and scatters go through numpy there, cheaper than torch's dispatch.
        self.host_view: np.ndarray | None = self.req_to_token.numpy() if self.device.type == "cpu" else None
        # A stack of free rows: pop from the end so that recently freed (cache-warm) rows are reused first.
        self._free_rows: list[int] = list(range(size - 1, -1, -1))
        self._is_free = [True] * size

    def available_size(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def is_free(self, row: int) -> bool:
        """Whether `row` (in [0, size)) is free."""
        return self._is_free[row]

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

    # ---- trusted accessors: kvmem's own layers, whose rows and positions were checked where they entered ------
    def row_slots(self, row: int, start: int, end: int) -> np.ndarray:
        """Slots of tokens start..end-1 of `row`: [end - start] int64 on the host (a copy)."""
        if self.host_view is not None:
            return self.host_view[row, start:end].astype(np.int64)
        return self.req_to_token[row, start:end].cpu().numpy().astype(np.int64)

    def slots_at(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The slot of token positions[i] of rows[i]: [n] int64 on the host."""
        if self.host_view is not None:
            return self.host_view[rows, positions].astype(np.int64)
        return self.req_to_token[torch.from_numpy(rows), torch.from_numpy(positions)].cpu().numpy().astype(np.int64)

    def set_slots_at(self, rows: np.ndarray, positions: np.ndarray, slots: torch.Tensor) -> None:
        """Writes slots[i] ([n] int64, any device) as token positions[i] of rows[i]."""
        if self.host_view is not None:
            self.host_view[rows, positions] = slots.cpu().numpy()
        else:
            self.req_to_token[torch.from_numpy(rows), torch.from_numpy(positions)] = slots.to(self.device, torch.int32)

    def set_row_slots(self, row: int, start: int, slots: np.ndarray | torch.Tensor) -> None:
        """Writes `slots` ([n] int64, host array or tensor) as tokens start..start+n-1 of `row`."""
        if self.host_view is not None:
            self.host_view[row, start:start + len(slots)] = slots.cpu().numpy() if isinstance(
                slots, torch.Tensor) else slots
        else:
            values = slots if isinstance(slots, torch.Tensor) else torch.from_numpy(slots)
            self.req_to_token[row, start:start + len(values)] = values.to(self.device, torch.int32)

    def write_extend(self, rows: list[int], prefix_lens: list[int], seq_lens: list[int], out_cache_loc: torch.Tensor,
                     prefixes: list[torch.Tensor | None]) -> None:
        """Writes an extend batch into its rows: request i's slots for tokens prefix_lens[i]..seq_lens[i]-1 (its
        share of `out_cache_loc`, requests in batch order) and, where prefixes[i] is not None, its cached prefix
        at tokens 0..len-1 (a chunked request's prefix is in its row already)."""
        if self.host_view is not None and out_cache_loc.device.type == "cpu":
            host, out, start = self.host_view, out_cache_loc.numpy(), 0
            for row, p, s, prefix in zip(rows, prefix_lens, seq_lens, prefixes):
                if prefix is not None and p:
                    host[row, :p] = prefix.cpu().numpy()
                host[row, p:s] = out[start:start + s - p]
                start += s - p
            return
        # Imported here: Triton's import is a large share of a process that only schedules.
        from kvmem.kernels.req_to_token import _write_req_to_token

        device = self.device
        counts = np.array([0 if prefix is None else prefix.numel() for prefix in prefixes], dtype=np.int64)
        prefix = ()
        if counts.any():
            indptr = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=indptr[1:])
            parts = [p for p in prefixes if p is not None]
            prefix = ((parts[0] if len(parts) == 1 else torch.cat(parts)).to(device),
                      torch.from_numpy(indptr).to(device))
        as_tensor = functools.partial(torch.tensor, device=device)
        _write_req_to_token(self.req_to_token, as_tensor(rows), as_tensor(prefix_lens), as_tensor(seq_lens),
                            out_cache_loc.to(device), *prefix)

    def free_row(self, row: int) -> None:
        """free's trusted body for one row its owner knows is allocated (the radix cache, for a Scheduler's
        request)."""
        self._is_free[row] = True
        self._free_rows.append(row)

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
