"""A real allocation failure on CPU: torch's CPU allocator wrapped (through `c10::SetCPUAllocator`) by one that
refuses an allocation once the bytes it has handed out and not yet had back would exceed a cap. The refusal is
torch's own `OutOfMemoryError`, raised where the tensor is allocated, in the middle of the forward or backward.

Unlike an address-space limit (RLIMIT_AS), it leaves the BLAS libraries' private buffers and the process's
other memory alone, so only tensor allocations fail. Built once with torch's JIT extension builder (cached in
TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

from functools import lru_cache

from torch.utils.cpp_extension import load_inline

SOURCE = r'''
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>

namespace {
struct CappedAllocator;
struct Context { c10::DataPtr inner; size_t bytes; CappedAllocator* owner; };

struct CappedAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> cap{-1};
  static void release(void* ptr);
  c10::DataPtr allocate(size_t bytes) override {
    int64_t limit = cap.load();
    if (limit >= 0 && live.load() + static_cast<int64_t>(bytes) > limit) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CappedAllocator: can't allocate memory: you tried to allocate ",
                       bytes, " bytes over the cap of ", limit, " live bytes (", live.load(), " in use)");
    }
    c10::DataPtr inner = base->allocate(bytes);
    void* data = inner.get();
    c10::Device device = inner.device();
    live += static_cast<int64_t>(bytes);
    auto* context = new Context{std::move(inner), bytes, this};
    return {data, context, &CappedAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

void CappedAllocator::release(void* ptr) {
  auto* context = static_cast<Context*>(ptr);
  context->owner->live -= static_cast<int64_t>(context->bytes);
  delete context;
}

CappedAllocator allocator;
}

void install(int64_t cap_bytes) {
  if (allocator.base == nullptr) {
    allocator.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
  }
  allocator.live = 0;
  allocator.cap = cap_bytes;
}

int64_t live_bytes() { return allocator.live.load(); }
'''


@lru_cache(maxsize=1)
def _extension():
    return load_inline("capped_cpu_allocator", cpp_sources=SOURCE, functions=["install", "live_bytes"])


def install(cap_bytes: int) -> None:
    """From now on, tensors allocated on the CPU may hold at most `cap_bytes` at once (-1: no cap); tensors that
    exist already are not counted."""
    _extension().install(cap_bytes)


def live_bytes() -> int:
    return _extension().live_bytes()
