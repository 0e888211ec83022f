"""The one direct-I/O loop (direct_io.direct_transfer) that the reader, the read-ahead and the writer use:
whole ALIGN units until done, a short transfer ends it, EINVAL turns direct I/O off, other errors raise."""

from __future__ import annotations

import errno

import pytest

from fp8conv.storage.direct_io import ALIGN, direct_transfer


def _op(chunks: list[int | OSError]):
    """An op that moves the next chunk's bytes per call (or raises it), recording the offsets asked."""
    asked: list[tuple[int, int]] = []

    def op(fd: int, view: memoryview, offset: int) -> int:
        asked.append((offset, len(view)))
        step = chunks.pop(0)
        if isinstance(step, OSError):
            raise step
        return min(step, len(view))

    return op, asked


def test_whole_units_until_the_view_is_done() -> None:
    op, asked = _op([ALIGN, 2 * ALIGN, ALIGN])
    assert direct_transfer(op, 3, memoryview(bytearray(4 * ALIGN)), 8 * ALIGN) == (4 * ALIGN, True)
    assert asked == [(8 * ALIGN, 4 * ALIGN), (9 * ALIGN, 3 * ALIGN), (11 * ALIGN, ALIGN)]


@pytest.mark.parametrize("short", [0, 100, ALIGN + 7])
def test_a_short_transfer_ends_it(short: int) -> None:
    op, asked = _op([ALIGN, short, ALIGN])
    assert direct_transfer(op, 3, memoryview(bytearray(4 * ALIGN)), 0) == (ALIGN + short, True)
    assert len(asked) == 2


def test_einval_turns_direct_io_off_and_keeps_what_was_moved() -> None:
    op, _ = _op([2 * ALIGN, OSError(errno.EINVAL, "Invalid argument")])
    assert direct_transfer(op, 3, memoryview(bytearray(4 * ALIGN)), 0) == (2 * ALIGN, False)


def test_any_other_error_is_raised() -> None:
    op, _ = _op([OSError(errno.ENOSPC, "No space left on device")])
    with pytest.raises(OSError, match="No space"):
        direct_transfer(op, 3, memoryview(bytearray(ALIGN)), 0)
