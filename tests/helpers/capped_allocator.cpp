// tests/helpers/capped_allocator.py: torch's CPU allocator wrapped by one that refuses an allocation over a cap
// with torch's own OutOfMemoryError. c10's headers only (no Python binding, no torch/extension.h): the build
// compiles in seconds instead of minutes; Python calls the two C entry points through ctypes.
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

extern "C" void capped_install(int64_t cap_bytes) {
  if (allocator.base == nullptr) {
    allocator.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
  }
  allocator.live = 0;
  allocator.cap = cap_bytes;
}

extern "C" int64_t capped_live_bytes() { return allocator.live.load(); }
