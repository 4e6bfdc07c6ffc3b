// New K and V rows stored into every layer's cache in one call, in place (the caches are
// aliased to the results). XLA:CPU wrote them as a few kernels a layer and cache (a
// slice, a roll, a select and an update for a chunk; a scatter for decode rows), and its
// compiled writes, one for each row count and chunk size an engine warms up, held twice
// the memory these do (benchmarks/kv_writes.py).
//
// Two forms of the new rows, as forward.py's steps return them:
//   rows   K and V [b, kv_heads, head_dim]: row r at position positions[r] of slot slots[r]
//   chunk  K [kv_heads, head_dim, t] and V [kv_heads, t, head_dim]: token j at position
//          positions[0] + j of slot slots[0]
// A position past the cache's end is dropped (a padded chunk's tail, as XLA's write).
// Caches: K in blocks of positions (kv_layout.py, qmatmul.h's key_offset) [slots,
// kv_heads, capacity / KEY_BLOCK, head_dim, KEY_BLOCK], V [slots, kv_heads, capacity,
// head_dim], all of one element type: float32, IEEE half or bfloat16, the new
// float32 values rounded to the nearest (ties to even) as XLA's conversion rounds them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "qmatmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, magnitude = x & 0x7fffffff;
  if (magnitude > 0x7f800000) return static_cast<uint16_t>(sign | 0x7e00 | (magnitude >> 13 & 0x3ff));  // NaN
  if (magnitude >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // rounds past 65504: infinity
  if (magnitude < 0x38800000) {  // a half subnormal (or zero): the value in units of 2^-24
    if (magnitude < 0x33000000) return static_cast<uint16_t>(sign);  // at most half a unit: zero
    const uint32_t exponent = magnitude >> 23, mantissa = (magnitude & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - exponent;  // 14 to 24 bits dropped
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (magnitude - 0x38000000) >> 13;  // rebias 127 → 15
  const uint32_t rest = magnitude & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | half);
}

uint16_t float_to_bfloat(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // NaN stays NaN
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void halves_f16c(const float* from, int64_t n, uint16_t* to) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) to[i] = _cvtss_sh(from[i], _MM_FROUND_TO_NEAREST_INT);
}
bool cpu_has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
}
std::atomic<bool> use_f16c{cpu_has_f16c()};
#endif

// n floats into n elements of type `type` at `to`.
void store(const float* from, int64_t n, ffi::DataType type, void* to) {
  if (type == ffi::DataType::F32) {
    std::memcpy(to, from, n * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(to);
  if (type == ffi::DataType::BF16) {
    for (int64_t i = 0; i < n; ++i) out[i] = float_to_bfloat(from[i]);
    return;
  }
#if defined(__x86_64__)
  if (use_f16c.load(std::memory_order_relaxed)) return halves_f16c(from, n, out);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_half(from[i]);
}

// n floats to n elements of `type`, `stride` elements apart: a K row goes down its
// cache's position axis. Converted together first, then placed.
void store_column(const float* from, int64_t n, int64_t stride, ffi::DataType type, void* to) {
  constexpr int64_t MOST = 512;
  uint32_t converted[MOST];
  const int64_t size = type == ffi::DataType::F32 ? 4 : 2;
  char* out = static_cast<char*>(to);
  for (int64_t first = 0; first < n; first += MOST) {
    const int64_t count = n - first < MOST ? n - first : MOST;
    store(from + first, count, type, converted);
    if (size == 2) {
      const uint16_t* halves = reinterpret_cast<const uint16_t*>(converted);
      uint16_t* to_halves = reinterpret_cast<uint16_t*>(out) + first * stride;
      for (int64_t i = 0; i < count; ++i) to_halves[i * stride] = halves[i];
    } else {
      uint32_t* to_words = reinterpret_cast<uint32_t*>(out) + first * stride;
      for (int64_t i = 0; i < count; ++i) to_words[i * stride] = converted[i];
    }
  }
}

// One layer's write: its caches, its new rows, and where they go.
struct LayerWrite {
  char* k_cache;
  char* v_cache;
  const float* k_new;
  const float* v_new;
};

// The caches' geometry and where a call's new rows go: the same for every layer.
struct Where {
  int64_t n_slots, heads, dim, capacity;
  int64_t count;  // rows, or the chunk's tokens
  bool chunk;
  const int32_t* slots;
  const int32_t* positions;

  // Where rows go; the geometry comes from the first layer (take).
  static Where of(bool chunk, const int32_t* slots, const int32_t* positions) {
    Where w{};
    w.chunk = chunk, w.slots = slots, w.positions = positions;
    return w;
  }

  // From layer 0's K cache [slots, heads, blocks, dim, KEY_BLOCK] and new K.
  void take(ffi::Span<const int64_t> kd, ffi::Span<const int64_t> nd) {
    n_slots = kd[0], heads = kd[1], dim = kd[3], capacity = kd[2] * kd[4];
    count = chunk ? nd[2] : nd[0];
  }

  // Whether a layer's K and V caches and new rows have this geometry.
  bool fits(ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd, ffi::Span<const int64_t> nd,
            int64_t slot_count, int64_t position_count) const {
    const bool caches = kd[0] == n_slots && kd[1] == heads && kd[3] == dim && kd[4] == motet_qmatmul::KEY_BLOCK &&
                        kd[2] * kd[4] == capacity &&
                        vd[0] == n_slots && vd[1] == heads && vd[2] == capacity && vd[3] == dim;
    if (chunk)
      return caches && nd[0] == heads && nd[1] == dim && nd[2] == count && slot_count == 1 && position_count == 1;
    return caches && nd[0] == count && nd[1] == heads && nd[2] == dim && slot_count == count && position_count == count;
  }

  // A chunk's tokens that land in the cache (the rest reach past its end), 0 for none.
  int64_t chunk_tokens() const {
    const int64_t slot = slots[0], offset = positions[0];
    if (slot < 0 || slot >= n_slots || offset < 0) return 0;
    return capacity - offset < count ? capacity - offset : count;
  }

  // Whether decode row r lands in the cache.
  bool row_lands(int64_t r) const {
    return slots[r] >= 0 && slots[r] < n_slots && positions[r] >= 0 && positions[r] < capacity;
  }
};

struct Write {
  std::vector<LayerWrite> layers;
  ffi::DataType type;
  int64_t size;  // bytes an element
  Where at;
};

void write_layer(void* arg, int64_t layer) {
  const Write& w = *static_cast<const Write*>(arg);
  const LayerWrite& l = w.layers[layer];
  const int64_t heads = w.at.heads, dim = w.at.dim, capacity = w.at.capacity, size = w.size, count = w.at.count;
  if (w.at.chunk) {  // K [h, d, t]: each (h, d) row's tokens are contiguous within a cache block too; V [h, t, d]
    const int64_t slot = w.at.slots[0], offset = w.at.positions[0], valid = w.at.chunk_tokens();
    if (valid <= 0) return;  // nothing in the cache: all dropped
    for (int64_t h = 0; h < heads; ++h) {
      char* keys = l.k_cache + (slot * heads + h) * dim * capacity * size;
      for (int64_t j = 0; j < valid;) {  // a run of tokens within one block
        const int64_t position = offset + j;
        const int64_t run = std::min(valid - j, motet_qmatmul::KEY_BLOCK - position % motet_qmatmul::KEY_BLOCK);
        for (int64_t d = 0; d < dim; ++d)
          store(l.k_new + (h * dim + d) * count + j, run, w.type,
                keys + (motet_qmatmul::key_offset(position, dim) + d * motet_qmatmul::KEY_BLOCK) * size);
        j += run;
      }
      store(l.v_new + h * count * dim, valid * dim, w.type, l.v_cache + ((slot * heads + h) * capacity + offset) * dim * size);
    }
    return;
  }
  for (int64_t r = 0; r < count; ++r) {  // K and V [r, h, d]
    if (!w.at.row_lands(r)) continue;  // dropped
    const int64_t slot = w.at.slots[r], position = w.at.positions[r];
    for (int64_t h = 0; h < heads; ++h) {
      store_column(l.k_new + (r * heads + h) * dim, dim, motet_qmatmul::KEY_BLOCK, w.type,
                   l.k_cache + ((slot * heads + h) * dim * capacity + motet_qmatmul::key_offset(position, dim)) * size);
      store(l.v_new + (r * heads + h) * dim, dim, w.type, l.v_cache + ((slot * heads + h) * capacity + position) * dim * size);
    }
  }
}

// The arguments after slots and positions: `expected`, or one more that only orders the
// write after what computes it (kv_writes.write_rows_traced: a step that writes its own
// rows runs the write last), never read.
bool ordered_args(size_t count, int64_t expected) {
  return static_cast<int64_t>(count) == expected || static_cast<int64_t>(count) == expected + 1;
}

ffi::Error KvWrite(ffi::ThreadPool threads, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> positions,
                   ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t layers, int64_t chunk) {
  if (layers < 1 || !ordered_args(args.size(), 4 * layers) || static_cast<int64_t>(rets.size()) != 2 * layers)
    return ffi::Error::InvalidArgument("kv_write: expected K and V caches and new rows for every layer");
  Write w{};
  w.at = Where::of(chunk != 0, slots.typed_data(), positions.typed_data());
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto k_out = rets.get<ffi::AnyBuffer>(layer), v_out = rets.get<ffi::AnyBuffer>(layers + layer);
    auto k_new = args.get<ffi::Buffer<ffi::F32>>(2 * layers + layer);
    auto v_new = args.get<ffi::Buffer<ffi::F32>>(3 * layers + layer);
    if (k_out.has_error() || v_out.has_error() || k_new.has_error() || v_new.has_error())
      return ffi::Error::InvalidArgument("kv_write: the new rows must be float32");
    ffi::AnyBuffer& k_cache = **k_out;
    ffi::AnyBuffer& v_cache = **v_out;
    const auto kd = k_cache.dimensions(), vd = v_cache.dimensions(), nd = k_new->dimensions();
    const ffi::DataType type = k_cache.element_type();
    if (kd.size() != 5 || vd.size() != 4 || nd.size() != 3 || v_cache.element_type() != type ||
        (type != ffi::DataType::F32 && type != ffi::DataType::F16 && type != ffi::DataType::BF16))
      return ffi::Error::InvalidArgument("kv_write: bad cache ranks or element types");
    if (layer == 0) {
      w.type = type;
      w.size = type == ffi::DataType::F32 ? 4 : 2;
      w.at.take(kd, nd);
    }
    if (type != w.type || !w.at.fits(kd, vd, nd, slots.element_count(), positions.element_count()) ||
        v_new->element_count() != k_new->element_count())
      return ffi::Error::InvalidArgument("kv_write: the new rows do not fit the caches");
    w.layers.push_back(LayerWrite{static_cast<char*>(k_cache.untyped_data()), static_cast<char*>(v_cache.untyped_data()),
                                  k_new->typed_data(), v_new->typed_data()});
  }
  motet_qmatmul::for_each_on_pool(&threads, layers, write_layer, &w);
  return ffi::Error::Success();
}

// ---- 8-bit caches (kv_quant.py) ----------------------------------------------------------
// Each new K or V vector (one position of one KV head) becomes head_dim bytes and a
// float32 scale (qmatmul.h's quantize_vector: the arithmetic of kv_quant.quantize, so
// both writes store the same bytes). The cache's type says which bytes: int8, or fp8's
// bit patterns as uint8.

struct ScaledLayer {
  uint8_t* k_values;  // [slots, heads, capacity / KEY_BLOCK, dim, KEY_BLOCK]
  uint8_t* v_values;  // [slots, heads, capacity, dim]
  float* k_scales;    // [slots, heads, capacity]
  float* v_scales;
  const float* k_new;
  const float* v_new;
};

struct ScaledWrite {
  std::vector<ScaledLayer> layers;
  int elem;  // qmatmul.h's I8 or E4M3
  Where at;
};

void write_scaled_layer(void* arg, int64_t layer) {
  const ScaledWrite& w = *static_cast<const ScaledWrite*>(arg);
  const ScaledLayer& l = w.layers[layer];
  const int64_t heads = w.at.heads, dim = w.at.dim, capacity = w.at.capacity, count = w.at.count;
  // one position j of head h of a slot: its K column, its V row and its scales
  auto store = [&](int64_t slot, int64_t h, int64_t position, const float* k, int64_t k_stride, const float* v) {
    const int64_t at = (slot * heads + h) * capacity + position;
    uint8_t* k_column = l.k_values + (slot * heads + h) * dim * capacity + motet_qmatmul::key_offset(position, dim);
    l.k_scales[at] = motet_qmatmul::quantize_vector(k, k_stride, dim, w.elem, k_column, motet_qmatmul::KEY_BLOCK);
    l.v_scales[at] = motet_qmatmul::quantize_vector(v, 1, dim, w.elem, l.v_values + at * dim, 1);
  };
  if (w.at.chunk) {  // K [h, d, t], V [h, t, d]
    const int64_t slot = w.at.slots[0], offset = w.at.positions[0], valid = w.at.chunk_tokens();
    if (valid <= 0) return;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < valid; ++j)
        store(slot, h, offset + j, l.k_new + h * dim * count + j, count, l.v_new + (h * count + j) * dim);
    return;
  }
  for (int64_t r = 0; r < count; ++r) {  // K and V [r, h, d]
    if (!w.at.row_lands(r)) continue;
    const int64_t slot = w.at.slots[r], position = w.at.positions[r];
    for (int64_t h = 0; h < heads; ++h)
      store(slot, h, position, l.k_new + (r * heads + h) * dim, 1, l.v_new + (r * heads + h) * dim);
  }
}

// Arguments: slots, positions, then per layer K values, V values, K scales, V scales
// (each group `layers` long, aliased to the results in that order), new K, new V.
ffi::Error KvWriteScaled(ffi::ThreadPool threads, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> positions,
                         ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t layers, int64_t chunk) {
  if (layers < 1 || !ordered_args(args.size(), 6 * layers) || static_cast<int64_t>(rets.size()) != 4 * layers)
    return ffi::Error::InvalidArgument("kv_write_scaled: expected values, scales and new rows for every layer");
  ScaledWrite w{};
  w.at = Where::of(chunk != 0, slots.typed_data(), positions.typed_data());
  for (int64_t layer = 0; layer < layers; ++layer) {
    auto k = rets.get<ffi::AnyBuffer>(layer), v = rets.get<ffi::AnyBuffer>(layers + layer);
    auto ks = rets.get<ffi::Buffer<ffi::F32>>(2 * layers + layer);
    auto vs = rets.get<ffi::Buffer<ffi::F32>>(3 * layers + layer);
    auto k_new = args.get<ffi::Buffer<ffi::F32>>(4 * layers + layer);
    auto v_new = args.get<ffi::Buffer<ffi::F32>>(5 * layers + layer);
    if (k.has_error() || v.has_error() || ks.has_error() || vs.has_error() || k_new.has_error() || v_new.has_error())
      return ffi::Error::InvalidArgument("kv_write_scaled: the scales and the new rows must be float32");
    const auto kd = (*k)->dimensions(), vd = (*v)->dimensions(), nd = k_new->dimensions();
    const auto type = (*k)->element_type();
    if (kd.size() != 5 || vd.size() != 4 || nd.size() != 3 || (*v)->element_type() != type ||
        (type != ffi::DataType::S8 && type != ffi::DataType::U8) ||
        (layer > 0 && (type == ffi::DataType::S8) != (w.elem == motet_qmatmul::I8)))
      return ffi::Error::InvalidArgument("kv_write_scaled: bad cache ranks or element types");
    if (layer == 0) {
      w.elem = type == ffi::DataType::S8 ? motet_qmatmul::I8 : motet_qmatmul::E4M3;
      w.at.take(kd, nd);
    }
    const int64_t positions_held = w.at.n_slots * w.at.heads * w.at.capacity;
    if (!w.at.fits(kd, vd, nd, slots.element_count(), positions.element_count()) ||
        static_cast<int64_t>((*ks)->element_count()) != positions_held ||
        static_cast<int64_t>((*vs)->element_count()) != positions_held ||
        v_new->element_count() != k_new->element_count())
      return ffi::Error::InvalidArgument("kv_write_scaled: the new rows do not fit the caches");
    w.layers.push_back(ScaledLayer{static_cast<uint8_t*>((*k)->untyped_data()),
                                   static_cast<uint8_t*>((*v)->untyped_data()), (*ks)->typed_data(),
                                   (*vs)->typed_data(), k_new->typed_data(), v_new->typed_data()});
  }
  motet_qmatmul::for_each_on_pool(&threads, layers, write_scaled_layer, &w);
  return ffi::Error::Success();
}

// Both writes' arguments: slots, positions, the caches and new rows, then attributes.
auto write_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .RemainingArgs()
      .RemainingRets()
      .Attr<int64_t>("layers")
      .Attr<int64_t>("chunk");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetKvWriteScaled, KvWriteScaled, write_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetKvWrite, KvWrite, write_binding());

// Halves rounded by F16C (on: where the CPU has it) or by float_to_half (off): tests
// compare both with XLA, as native.select_instruction_set("base") turns it off. Returns
// whether F16C is in use.
extern "C" int motet_kv_write_f16c(int on) {
#if defined(__x86_64__)
  use_f16c.store(on && cpu_has_f16c());
  return use_f16c.load();
#else
  return 0;
#endif
}
