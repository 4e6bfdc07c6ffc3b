// A new KV cache's zeros, and a slot's first positions copied over another's: the cache
// operations besides a step's writes (kv_write.cc), each one native call for every layer.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Zeroed caches whose pages count in the resident set only once written: every whole
// page of a result is handed back to the kernel (MADV_DONTNEED: a private anonymous page
// then reads as zeros until written), the partial pages at its ends are zeroed. XLA's
// zeros write every byte, so a cache of 16 slots held its full size from the start,
// however few positions the conversations used.
ffi::Error KvZeros(ffi::RemainingRets rets) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (size_t i = 0; i < rets.size(); ++i) {
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return ffi::Error::InvalidArgument("kv_zeros: a result is not a buffer");
    uint8_t* start = static_cast<uint8_t*>((*out)->untyped_data());
    uint8_t* end = start + (*out)->size_bytes();
    uint8_t* first = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(start) + page - 1) / page * page);
    uint8_t* last = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(end) / page * page);
    if (last <= first || madvise(first, static_cast<size_t>(last - first), MADV_DONTNEED) != 0) {
      std::memset(start, 0, static_cast<size_t>(end - start));
      continue;
    }
    std::memset(start, 0, static_cast<size_t>(first - start));
    std::memset(last, 0, static_cast<size_t>(end - last));
  }
  return ffi::Error::Success();
}

// The first `positions` positions of slot `from` copied over slot `to`'s, in every cache
// given (aliased to the results): a prompt's prefix another slot holds. The caches come
// as kv_write's (K [slots, kv_heads, head_dim, capacity] for layers 0 .. layers - 1,
// then V [slots, kv_heads, capacity, head_dim]), then an 8-bit cache's scales [slots,
// kv_heads, capacity]. A slot's positions are then `outer` runs of positions * inner
// elements each. XLA's copy took the whole slot, and so touched every page of the
// target's V however short the prefix.
ffi::Error KvCopy(ffi::Buffer<ffi::S32> where, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t layers) {
  if (where.element_count() != 3 || args.size() != rets.size())
    return ffi::Error::InvalidArgument("kv_copy: expected (from, to, positions) and caches aliased to results");
  const int32_t from = where.typed_data()[0], to = where.typed_data()[1];
  for (size_t i = 0; i < rets.size(); ++i) {
    auto cache = rets.get<ffi::AnyBuffer>(i);
    if (cache.has_error()) return ffi::Error::InvalidArgument("kv_copy: a cache is not a buffer");
    const auto d = (*cache)->dimensions();
    const bool values = d.size() == 4, is_k = values && static_cast<int64_t>(i) < layers;
    if ((!values && d.size() != 3) || from < 0 || to < 0 || from >= d[0] || to >= d[0])
      return ffi::Error::InvalidArgument("kv_copy: caches of rank 4 (values) or 3 (scales), slots in range");
    // [slots, outer, capacity, inner]
    const int64_t outer = is_k ? d[1] * d[2] : d[1], capacity = is_k ? d[3] : d[2];
    const int64_t inner = values && !is_k ? d[3] : 1;
    const int64_t positions = std::min(static_cast<int64_t>(std::max(where.typed_data()[2], 0)), capacity);
    const size_t element = (*cache)->size_bytes() / static_cast<size_t>(d[0] * outer * capacity * inner);
    uint8_t* data = static_cast<uint8_t*>((*cache)->untyped_data());
    const size_t run = static_cast<size_t>(positions * inner) * element, stride = capacity * inner * element;
    for (int64_t o = 0; o < outer; ++o)
      std::memmove(data + (to * outer + o) * stride, data + (from * outer + o) * stride, run);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetKvZeros, KvZeros, ffi::Ffi::Bind().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetKvCopy, KvCopy,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("layers"));
