"""A real allocation failure on CPU: torch's CPU allocator wrapped (through `c10::SetCPUAllocator`) by one that
refuses an allocation once the bytes it has handed out and not yet had back would exceed a cap. The refusal is
torch's own `OutOfMemoryError`, raised where the tensor is allocated, in the middle of the forward or backward.

Unlike an address-space limit (RLIMIT_AS), it leaves the BLAS libraries' private buffers and the process's
other memory alone, so only tensor allocations fail. Built once with torch's JIT extension builder (cached in
TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

from torch.utils.cpp_extension import _get_build_directory, load

NAME = "capped_cpu_allocator"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capped_allocator.cpp")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """The built library, loaded into this process (the allocator must live in the process whose tensors it counts)."""
    load(NAME, sources=[SOURCE], is_python_module=False)
    library = ctypes.CDLL(os.path.join(_get_build_directory(NAME, verbose=False), f"{NAME}.so"))
    library.capped_install.argtypes, library.capped_install.restype = [ctypes.c_int64], None
    library.capped_live_bytes.argtypes, library.capped_live_bytes.restype = [], ctypes.c_int64
    return library


def install(cap_bytes: int) -> None:
    """From now on, tensors allocated on the CPU may hold at most `cap_bytes` at once (-1: no cap); tensors that
    exist already are not counted."""
    _library().capped_install(cap_bytes)


def live_bytes() -> int:
    return _library().capped_live_bytes()
