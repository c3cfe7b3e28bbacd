"""harness/allocator.py: glibc keeps large tensors' memory for reuse instead of mapping each
temporary afresh; the setting is real (read back from the C library) and changes no result."""
import ctypes
import platform

import pytest

from harness import allocator


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_policy_is_taken_and_a_large_block_then_comes_from_the_heap():
    """After reuse_freed_memory a 16 MiB block is carved from the heap (malloc_usable_size of a
    heap chunk, and mallinfo2's arena grows), where by default it would be its own mapping."""
    assert allocator.reuse_freed_memory() is True
    libc = ctypes.CDLL(None)

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    mapped_before = libc.mallinfo2().hblks
    block = libc.malloc(16 << 20)
    try:
        assert libc.mallinfo2().hblks == mapped_before       # no new mmap'ed block
    finally:
        libc.free(block)


def test_worker_environment_states_the_same_policy():
    env = allocator.worker_environment()
    assert env == {"MALLOC_MMAP_THRESHOLD_": str(allocator.MMAP_THRESHOLD),
                   "MALLOC_TRIM_THRESHOLD_": str(allocator.TRIM_THRESHOLD)}
    assert allocator.MMAP_THRESHOLD == 32 << 20               # glibc's largest on 64-bit
