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
// as kv_write's (K [slots, kv_heads, blocks, head_dim, KEY_BLOCK] for layers 0 .. layers
// - 1, then V [slots, kv_heads, capacity, head_dim]), then an 8-bit cache's scales
// [slots, kv_heads, capacity]. A (slot, head)'s positions are one run in each, K's in
// whole blocks: the copy takes the blocks that hold the prefix, V and the scales just
// its positions. XLA's copy took the whole slot, and so touched every page of the
// target's V however short the prefix.
ffi::Error KvCopy(ffi::Buffer<ffi::S32> where, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t layers) {
  if (where.element_count() != 3 || args.size() != rets.size())
    return ffi::Error::InvalidArgument("kv_copy: expected (from, to, positions) and caches aliased to results");
  const int32_t from = where.typed_data()[0], to = where.typed_data()[1];
  for (size_t i = 0; i < rets.size(); ++i) {
    auto cache = rets.get<ffi::AnyBuffer>(i);
    if (cache.has_error()) return ffi::Error::InvalidArgument("kv_copy: a cache is not a buffer");
    const auto d = (*cache)->dimensions();
    const bool is_k = static_cast<int64_t>(i) < layers;
    const size_t rank = is_k ? 5 : static_cast<int64_t>(i) < 2 * layers ? 4 : 3;
    if (d.size() != rank || from < 0 || to < 0 || from >= d[0] || to >= d[0])
      return ffi::Error::InvalidArgument("kv_copy: caches of rank 5 (K), 4 (V) or 3 (scales), slots in range");
    // a (slot, head)'s run: `capacity` positions of `inner` elements, K's by blocks
    const int64_t capacity = is_k ? d[2] * d[4] : d[2];
    const int64_t inner = rank == 3 ? 1 : d[3];  // head_dim
    int64_t positions = std::min(static_cast<int64_t>(std::max(where.typed_data()[2], 0)), capacity);
    if (is_k) positions = (positions + d[4] - 1) / d[4] * d[4];
    const size_t element = (*cache)->size_bytes() / static_cast<size_t>(d[0] * d[1] * capacity * inner);
    uint8_t* data = static_cast<uint8_t*>((*cache)->untyped_data());
    const size_t run = static_cast<size_t>(positions * inner) * element, stride = capacity * inner * element;
    for (int64_t head = 0; head < d[1]; ++head)
      std::memmove(data + (to * d[1] + head) * stride, data + (from * d[1] + head) * stride, run);
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
