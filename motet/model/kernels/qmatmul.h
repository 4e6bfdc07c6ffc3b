// Quantized matrix products for XLA:CPU, which fuses no dequantization into its dot.
// out[m, n] = sum_k x[m, k] * w[n, k], with w stored as the repacked layouts of
// motet/model/quant.py; one weight value is q * scale + min over its block.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace motet_qmatmul {

// P8 and P4: Q6_K's and Q5_K's int8 values and Q4_K's 4-bit ones held as the integer
// pairs' panels of 16 rows (panels_avx2.inc), which only the AVX2 and AVX-512 VNNI
// kernels read (panels_vnni.inc).
enum Kind : int { Q4 = 0, Q8 = 1, P8 = 2, P4 = 3 };
constexpr bool four_bits(int kind) { return kind == Q4 || kind == P4; }

// Scales or mins kept in fewer bytes than floats, as the file keeps them, and widened a
// unit's rows at a time (row_range in qmatmul_body.inc), so the loops read floats:
// IEEE halves (Q4_0, Q4_1, Q8_0), or small integers times a float per `group` blocks
// (the K types: a 6-bit scale per 16 or 32 values, an f16 per 256).
enum PackedForm : int { PLAIN = 0, HALVES = 1, BYTES = 2, SIGNED_BYTES = 3 };
struct Packed {
  int form;             // PLAIN: none (the float array is given instead)
  const void* data;     // [n, k/block] halves, uint8 or int8
  const float* super;   // [n, k/block/group] (the byte forms)
  int64_t group;        // blocks per super entry
  Packed moved(int64_t entries) const;  // moved on `entries` entries (whole groups)
};

// What a KV cache holds: float32, or 16-bit floats (IEEE half, as llama.cpp's cache, or
// bfloat16), widened to float32 as they are read; or bytes, I8 and E4M3 (fp8), with a
// float32 scale per position and KV head ([slots, kv_heads, capacity]), the value times
// its scale being the number.
enum Elem : int { F32 = 0, F16 = 1, BF16 = 2, I8 = 3, E4M3 = 4 };
constexpr bool scaled(int elem) { return elem == I8 || elem == E4M3; }
// The largest magnitude of each 8-bit cache type: a vector's scale is its own over this.
constexpr float scaled_top(int elem) { return elem == I8 ? 127.f : 448.f; }

// float32 to fp8 e4m3, rounded to the nearest (ties to even); |f| is at most 448.
inline uint8_t float_to_e4m3(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80);
  const uint32_t magnitude = x & 0x7fffffff;
  if (magnitude > 0x7f800000) return sign | 0x7f;  // NaN
  if (magnitude < 0x3c800000)  // under e4m3's smallest normal, 2^-6: units of 2^-9 (8 of them is that normal)
    return sign | static_cast<uint8_t>(std::nearbyint(std::fabs(f) * 512.f));
  const uint32_t rounded = magnitude + 0x7ffff + ((magnitude >> 20) & 1);  // keep 3 mantissa bits
  const uint32_t bits = (rounded >> 20) - (120u << 3);  // the exponent rebiased 127 → 7
  return sign | static_cast<uint8_t>(bits < 0x7e ? bits : 0x7e);
}

// kv_quant.quantize's arithmetic for one vector of n values `from_stride` apart, in an
// 8-bit cache of type elem: each value's byte into to[i * to_stride]; returns the
// vector's scale (its largest magnitude over scaled_top, computed as XLA computes it:
// times the constant's reciprocal). The native write and the attention's rounding of a
// step's own rows both use it, so both give back what XLA's write stores.
inline float quantize_vector(const float* from, int64_t from_stride, int64_t n, int elem, uint8_t* to,
                             int64_t to_stride) {
  const float top = scaled_top(elem);
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(from[i * from_stride]));
  const float inverse = amax > 0.f ? top / amax : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = from[i * from_stride] * inverse;
    const float step = std::fmin(std::fmax(std::nearbyint(x), -top), top);  // int8's
    to[i * to_stride] = elem == I8 ? static_cast<uint8_t>(static_cast<int8_t>(step)) : float_to_e4m3(x);
  }
  return amax * (1.f / top);
}

struct QWeights {
  int kind;               // Q4: two 4-bit values a byte; Q8: one int8 a byte
  int block;              // values per scale: 32 for Q4, 16 or 32 for Q8
  int64_t n, k;           // rows (outputs) and columns (inputs)
  const uint8_t* values;  // Q4 [n, k/2] (byte i of a block: value i low, i+16 high); Q8 [n, k]
  const float* scale;     // [n, k/block]
  const float* min;       // [n, k/block], or null for none
  // In place of scale and min where they are packed (a 4-bit layout's float scale and
  // min would add a third to its bytes)
  Packed packed_scale;
  Packed packed_min;
  // What x is quantized to: int16 per 32 values (16), or int8 (8) where a kernel has
  // that form (AVX2's many-row products; elsewhere int16). 8 on a Q8 matrix also says
  // its values lie within [-32, 31] (quant.py's with_x_bits sets it so only then).
  int x_bits = 16;
};

// A panel's blocks a super entry covers, by the form of its factors: known to the
// compiler, so a tile finds a block's entry by a shift (a division each block was in the
// loop of a one-row product).
constexpr int64_t panel_group(int form) { return form == SIGNED_BYTES ? 16 : form == BYTES ? 8 : 1; }

// Whether w is Q8_0 held as panels (P8 with half-float scales): its int8 values plus 128,
// whose products AVX2's vpmaddubsw would saturate, so only AVX-512 VNNI's read them.
inline bool eight_bit_panels(const QWeights& w) { return w.kind == P8 && w.packed_scale.form == HALVES; }

// Why w (P8 or P4) is not what the panels' kernels read, or null: whole panels of Q6_K
// blocks (P8, blocks of 16: int8 scales, a super entry per 16 blocks, no mins), Q5_K
// (P8) or Q4_K (P4) ones (blocks of 32: byte scales and mins, a super entry each per 8),
// Q4_1 and Q4_0 ones (P4: half-float scales and mins), or Q8_0 ones (P8: half-float
// scales, no mins).
inline const char* panels_unfit(const QWeights& w) {
  const bool six = w.kind == P8 && w.block == 16, halves = w.packed_scale.form == HALVES;
  const bool no_mins = six || (w.kind == P8 && halves);
  const int form = six ? SIGNED_BYTES : halves ? HALVES : BYTES;
  if (w.n % 16 || w.block != (six ? 16 : 32) || w.packed_scale.form != form || w.packed_scale.group != panel_group(form) ||
      (no_mins ? w.packed_min.form || w.min : w.packed_min.form != form))
    return "p8 and p4 are Q6_K, Q5_K, Q4_K, Q4_1, Q4_0 and Q8_0 blocks in 16-row panels";
  return nullptr;
}

// Runs task(arg, unit) once for every unit in [0, units), on as many threads as it has,
// and returns when all have run (qmatmul_ffi.cc: XLA's own intra-op threads). `threads`
// take units, the caller among them: a product cuts a large matrix into a few units a
// thread, each a long run of its rows.
using Task = void (*)(void* arg, int64_t unit);
struct Parallel {
  void* pool;
  void (*for_each)(void* pool, int64_t units, Task task, void* arg);
  int64_t threads;
};
// Parallel's for_each on XLA's intra-op pool (pool: an xla::ffi::ThreadPool).
void for_each_on_pool(void* pool, int64_t units, Task task, void* arg);

// A K cache holds each (slot, KV head)'s positions in blocks of KEY_BLOCK, a block
// [head_dim, KEY_BLOCK] (kv_layout.py): position p of dimension d lies at
// key_offset(p, head_dim) + d * KEY_BLOCK from the (slot, head)'s first key, which is
// (slot * kv_heads + head) * head_dim * capacity in, as V's first row is.
constexpr int64_t KEY_BLOCK = 64;
inline int64_t key_offset(int64_t position, int64_t head_dim) {
  return position / KEY_BLOCK * KEY_BLOCK * head_dim + position % KEY_BLOCK;
}

// Decode attention (attend_body.inc): each row's new query heads over its slot's
// cached positions < position[row] and over the row's own new key and value. The
// layouts are forward.py's: queries grouped by KV head, K cached in blocks (above).
struct Attention {
  int64_t rows, kv_heads, group, head_dim;
  int64_t slots, capacity;  // the cache's slots and positions
  float scale;              // applied to the queries
  const float* q;           // [rows, kv_heads, group, head_dim]
  const float* k_new;       // [rows, kv_heads, head_dim]
  const float* v_new;       // [rows, kv_heads, head_dim]
  const void* k_cache;      // [slots, kv_heads, capacity / KEY_BLOCK, head_dim, KEY_BLOCK] of cache_elem
  const void* v_cache;      // [slots, kv_heads, capacity, head_dim] of cache_elem
  int cache_elem;
  const float* k_scales;    // [slots, kv_heads, capacity] where scaled(cache_elem)
  const float* v_scales;
  const int32_t* slot;      // [rows]
  const int32_t* position;  // [rows]
  float* out;               // [rows, kv_heads, group, head_dim]
};

inline Packed Packed::moved(int64_t entries) const {
  Packed p = *this;
  if (form == HALVES) p.data = static_cast<const uint16_t*>(data) + entries;
  if (form == BYTES || form == SIGNED_BYTES) {
    p.data = static_cast<const uint8_t*>(data) + entries;
    p.super = super + entries / group;
  }
  return p;
}

using Impl = void (*)(const QWeights&, const float* x, int64_t m, float* out, const Parallel&);

// Weight rows the AVX-512 one-row dots take in one pass: set by the CPU's vendor, or by
// motet_qmatmul_rows_at_once (tests run both forms on any CPU). qmatmul_ffi.cc keeps it.
int avx512_rows_at_once();

// A stack of matrices [count, n, k] in one layout (a layer's experts): matrix e is
// `first` with its pointers moved e matrices on.
struct QStack {
  QWeights first;
  int64_t count;
  QWeights matrix(int64_t e) const {
    const int64_t row_bytes = four_bits(first.kind) ? first.k / 2 : first.k, blocks = first.k / first.block;
    QWeights w = first;
    const int64_t scales = e * first.n * blocks;
    w.values += e * first.n * row_bytes;
    if (w.scale) w.scale += scales;
    if (w.min) w.min += scales;
    w.packed_scale = w.packed_scale.moved(scales);
    w.packed_min = w.packed_min.moved(scales);
    return w;
  }
};

// A MoE layer's routed experts (moe.cc): out[t] = Σ_j weight[t, j] · down_e(swiglu(
// gate_up_e(x[t]))) over e = ids[t, j], with swiglu(h) = silu(h[:f]) · h[f:].
struct Experts {
  int64_t tokens, k;     // rows of x, experts per row
  const float* x;        // [tokens, d]
  const int32_t* ids;    // [tokens, k]: matrices of the stacks (clamped into them)
  const float* weights;  // [tokens, k]
  QStack gate_up;        // [E, 2f, d]
  QStack down;           // [E, d, f]
  float* out;            // [tokens, d]
};
// out[r] = silu(h[r, :f]) · h[r, f:] for each of `rows` rows of h [rows, 2f] (swiglu_body.inc).
using SwigluImpl = void (*)(const float* h, int64_t rows, int64_t f, float* out);
void moe_experts(const Experts&, Impl product, SwigluImpl swiglu, const Parallel&);
// Prefill attention: a chunk's tokens, causally among themselves, over a slot's cached
// positions < offset first (none where k_cache is null).
struct ChunkAttention {
  int64_t tokens, kv_heads, group, head_dim;
  int64_t slots, capacity;
  float scale;
  const float* q;        // [tokens, kv_heads, group, head_dim]
  const float* k_chunk;  // [kv_heads, head_dim, tokens]: transposed, as a cache's block keeps K
  const float* v_chunk;  // [kv_heads, tokens, head_dim]
  const void* k_cache;   // as Attention's, or null
  const void* v_cache;
  int cache_elem;
  const float* k_scales;  // as Attention's
  const float* v_scales;
  int64_t slot, offset;
  float* out;            // [tokens, kv_heads, group, head_dim]
};

using AttendImpl = void (*)(const Attention&, const Parallel&);
using ChunkImpl = void (*)(const ChunkAttention&, const Parallel&);

#define MOTET_KERNELS                                                           \
  void qmatmul(const QWeights&, const float*, int64_t, float*, const Parallel&); \
  void attend_rows(const Attention&, const Parallel&);                            \
  void attend_chunk(const ChunkAttention&, const Parallel&);                     \
  void swiglu(const float*, int64_t, int64_t, float*);
namespace base { MOTET_KERNELS }
#if defined(__x86_64__)
namespace avx2 { MOTET_KERNELS }
namespace avx512 { MOTET_KERNELS }
namespace avx512vnni { MOTET_KERNELS }
#endif
#undef MOTET_KERNELS

}  // namespace motet_qmatmul
