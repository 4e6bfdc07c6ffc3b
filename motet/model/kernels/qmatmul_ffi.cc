// The XLA FFI handlers (registered from motet/model/native.py) and the run-time choice
// of instruction set.
#include <atomic>
#include <cstring>
#include <string>
#include <utility>

#include "qmatmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using motet_qmatmul::Impl;
using motet_qmatmul::QWeights;

namespace {

// Which panels (qmatmul.h's P8, P4) an instruction set's kernels read: none, all but
// Q8_0's (AVX2: panels_avx2.inc), or all (AVX-512 VNNI: panels_vnni.inc).
enum Panels : int { NO_PANELS, SMALL_PANELS, ALL_PANELS };

struct Choice {
  const char* name;
  Impl impl;
  motet_qmatmul::AttendImpl attend;
  motet_qmatmul::ChunkImpl attend_chunk;
  motet_qmatmul::SwigluImpl swiglu;
  int panels;  // the panels it reads: NO_PANELS, SMALL_PANELS (all but Q8_0's) or ALL_PANELS
};

#define MOTET_CHOICE(isa, panels) \
  Choice{#isa, motet_qmatmul::isa::qmatmul, motet_qmatmul::isa::attend_rows, motet_qmatmul::isa::attend_chunk, \
         motet_qmatmul::isa::swiglu, panels}

Choice best_for_this_cpu() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512vnni") ? MOTET_CHOICE(avx512vnni, ALL_PANELS) : MOTET_CHOICE(avx512, NO_PANELS);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return MOTET_CHOICE(avx2, SMALL_PANELS);
#endif
  return MOTET_CHOICE(base, NO_PANELS);
}

Choice& chosen() {
  static Choice choice = best_for_this_cpu();
  return choice;
}

// Work shared out over XLA's intra-op threads, as the FFI hands them to a call.
motet_qmatmul::Parallel on_pool(ffi::ThreadPool& threads) {
  return {&threads, motet_qmatmul::for_each_on_pool, threads.num_threads()};
}

// 0 until set: then the CPU's vendor decides (matvec_avx512.inc says why)
std::atomic<int> rows_at_once{0};

// A matrix's scales (or mins) from their buffer, `offset` entries in: floats, or packed
// (quant.py's QTensor: f16, or uint8 / int8 times a float32 `super` entry per `group`).
// False for any other element type, or a super buffer of the wrong size.
bool scales_at(const ffi::AnyBuffer& b, const ffi::AnyBuffer& super, int64_t group, int64_t offset,
               const float*& floats, motet_qmatmul::Packed& packed) {
  using motet_qmatmul::Packed;
  floats = nullptr;
  packed = Packed{};
  const auto type = b.element_type();
  if (type == ffi::DataType::F32) {
    floats = static_cast<const float*>(b.untyped_data()) + offset;
    return true;
  }
  if (type == ffi::DataType::F16) {
    packed = Packed{motet_qmatmul::HALVES, static_cast<const uint16_t*>(b.untyped_data()) + offset, nullptr, 1};
    return true;
  }
  if ((type != ffi::DataType::U8 && type != ffi::DataType::S8) || group < 1 ||
      super.element_type() != ffi::DataType::F32 || b.element_count() != super.element_count() * group)
    return false;
  packed = Packed{type == ffi::DataType::U8 ? motet_qmatmul::BYTES : motet_qmatmul::SIGNED_BYTES,
                  static_cast<const uint8_t*>(b.untyped_data()) + offset,
                  static_cast<const float*>(super.untyped_data()) + offset / group, group};
  return true;
}

// A matrix's scales and mins (none unless has_min) into w, or false.
bool set_scales(QWeights& w, const ffi::AnyBuffer& scale, const ffi::AnyBuffer& mins, const ffi::AnyBuffer& super_scale,
                const ffi::AnyBuffer& super_min, int64_t group, int64_t has_min, int64_t offset) {
  if (!scales_at(scale, super_scale, group, offset, w.scale, w.packed_scale)) return false;
  if (has_min) return scales_at(mins, super_min, group, offset, w.min, w.packed_min);
  w.min = nullptr;
  w.packed_min = motet_qmatmul::Packed{};
  return true;
}

// One quantized matrix, or a stack of them, as quant.py's QTensor passes it: values,
// scales, mins (read where has_min), the super entries of packed scales and mins (read
// where their element type says so), and its attributes.
struct Matrix {
  ffi::AnyBuffer values, scale, mins, super_scale, super_min;
  int64_t kind, block, has_min, group, x_bits;
};

// Matrix `index` of m (a stack [stack, n, row bytes], or one matrix [n, row bytes] and
// index 0) for rows of k values, or an error naming `what`.
ffi::Error matrix_of(const Matrix& m, int64_t k, int64_t index, const char* what, QWeights& w, int64_t& stack) {
  const auto vd = m.values.dimensions();
  const std::string bad = std::string(what) + ": shapes do not agree";
  if (vd.size() < 2 || vd.size() > 3 || m.block <= 0) return ffi::Error::InvalidArgument(std::string(what) + ": bad ranks");
  stack = vd.size() == 3 ? vd[0] : 1;
  const int64_t n = vd[vd.size() - 2], row_bytes = motet_qmatmul::four_bits(m.kind) ? k / 2 : k, blocks = k / m.block;
  if (vd.back() != row_bytes || k % m.block != 0 || m.kind < 0 || m.kind > motet_qmatmul::P4 ||
      (m.kind == motet_qmatmul::Q4 && (m.block != 32 || !m.has_min)) ||
      static_cast<int64_t>(m.scale.element_count()) != stack * n * blocks ||
      (m.has_min && m.mins.element_count() != m.scale.element_count()))
    return ffi::Error::InvalidArgument(bad);
  index = std::clamp<int64_t>(index, 0, stack - 1);  // as XLA clamps a dynamic slice
  w = QWeights{static_cast<int>(m.kind), static_cast<int>(m.block), n, k,
               static_cast<const uint8_t*>(m.values.untyped_data()) + index * n * row_bytes};
  if (m.x_bits != 8 && m.x_bits != 16) return ffi::Error::InvalidArgument(std::string(what) + ": x_bits is 8 or 16");
  w.x_bits = static_cast<int>(m.x_bits);
  if (!set_scales(w, m.scale, m.mins, m.super_scale, m.super_min, m.group, m.has_min, index * n * blocks))
    return ffi::Error::InvalidArgument(std::string(what) + ": scales and mins must be float32, float16, or "
                                       "uint8 or int8 with float32 super entries");
  if ((w.packed_scale.super || w.packed_min.super) && blocks % m.group != 0)  // rows of whole groups
    return ffi::Error::InvalidArgument(bad);
  if (w.kind == motet_qmatmul::P8 || w.kind == motet_qmatmul::P4) {
    const char* unfit = motet_qmatmul::panels_unfit(w);
    if (!unfit && chosen().panels == NO_PANELS) unfit = "panels are read by the AVX2 and AVX-512 VNNI kernels only";
    if (!unfit && chosen().panels == SMALL_PANELS && motet_qmatmul::eight_bit_panels(w))
      unfit = "Q8_0 in panels is read by the AVX-512 VNNI kernels only";
    if (unfit) return ffi::Error::InvalidArgument(std::string(what) + ": " + unfit);
  }
  return ffi::Error::Success();
}

// x [..., k] times matrix `index` of m: the kernels read it in place, so an expert of a
// stack is never copied out.
ffi::Error Product(ffi::ThreadPool& threads, ffi::Buffer<ffi::F32>& x, const Matrix& m,
                   ffi::ResultBuffer<ffi::F32>& out, int64_t index) {
  const auto xd = x.dimensions();
  if (xd.size() < 1) return ffi::Error::InvalidArgument("qmatmul: bad ranks");
  const int64_t k = xd.back(), rows = k ? static_cast<int64_t>(x.element_count()) / k : 0;
  QWeights w{};
  int64_t stack = 0;
  if (auto e = matrix_of(m, k, index, "qmatmul", w, stack); e.failure()) return e;
  if (static_cast<int64_t>(out->element_count()) != rows * w.n)
    return ffi::Error::InvalidArgument("qmatmul: shapes do not agree");
  chosen().impl(w, x.typed_data(), rows, out->typed_data(), on_pool(threads));
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::AnyBuffer scale,
                   ffi::AnyBuffer mins, ffi::AnyBuffer super_scale, ffi::AnyBuffer super_min,
                   ffi::ResultBuffer<ffi::F32> out, int64_t kind, int64_t block, int64_t has_min, int64_t group,
                   int64_t x_bits) {
  if (values.dimensions().size() != 2) return ffi::Error::InvalidArgument("qmatmul: bad ranks");
  return Product(threads, x, Matrix{values, scale, mins, super_scale, super_min, kind, block, has_min, group, x_bits},
                 out, 0);
}

ffi::Error QMatmulStacked(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                          ffi::AnyBuffer scale, ffi::AnyBuffer mins, ffi::AnyBuffer super_scale,
                          ffi::AnyBuffer super_min, ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<ffi::F32> out,
                          int64_t kind, int64_t block, int64_t has_min, int64_t group, int64_t x_bits) {
  if (values.dimensions().size() != 3 || index.element_count() != 1)
    return ffi::Error::InvalidArgument("qmatmul_stacked: bad ranks");
  return Product(threads, x, Matrix{values, scale, mins, super_scale, super_min, kind, block, has_min, group, x_bits},
                 out, index.typed_data()[0]);
}

// A stack [count, n, k] of one layout from its buffers, or an error.
ffi::Error stack_of(const Matrix& m, motet_qmatmul::QStack& stack) {
  const auto vd = m.values.dimensions();
  if (vd.size() != 3) return ffi::Error::InvalidArgument("moe_experts: bad stack ranks");
  const int64_t k = motet_qmatmul::four_bits(m.kind) ? vd[2] * 2 : vd[2];
  return matrix_of(m, k, 0, "moe_experts", stack.first, stack.count);
}

// A MoE layer's routed experts (qmatmul.h's Experts): x [tokens, d], ids and weights
// [tokens, k], the gate_up [E, 2f, d] and down [E, d, f] stacks.
ffi::Error MoeExperts(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer gu_values, ffi::AnyBuffer gu_scale,
                      ffi::AnyBuffer gu_mins, ffi::AnyBuffer gu_super_scale, ffi::AnyBuffer gu_super_min,
                      ffi::AnyBuffer down_values, ffi::AnyBuffer down_scale, ffi::AnyBuffer down_mins,
                      ffi::AnyBuffer down_super_scale, ffi::AnyBuffer down_super_min, ffi::ResultBuffer<ffi::F32> out,
                      int64_t gu_kind, int64_t gu_block, int64_t gu_has_min, int64_t gu_group, int64_t gu_x_bits,
                      int64_t down_kind, int64_t down_block, int64_t down_has_min, int64_t down_group,
                      int64_t down_x_bits) {
  motet_qmatmul::Experts m{};
  const Matrix gate_up{gu_values, gu_scale, gu_mins, gu_super_scale, gu_super_min,
                       gu_kind, gu_block, gu_has_min, gu_group, gu_x_bits};
  const Matrix down{down_values, down_scale, down_mins, down_super_scale, down_super_min,
                    down_kind, down_block, down_has_min, down_group, down_x_bits};
  if (auto e = stack_of(gate_up, m.gate_up); e.failure()) return e;
  if (auto e = stack_of(down, m.down); e.failure()) return e;
  const auto xd = x.dimensions(), id = ids.dimensions();
  const int64_t d = m.gate_up.first.k, f = m.gate_up.first.n / 2;
  if (xd.size() != 2 || id.size() != 2 || xd[0] != id[0] || xd[1] != d || weights.element_count() != ids.element_count() ||
      m.down.count != m.gate_up.count || m.down.first.n != d || m.down.first.k != f || m.gate_up.first.n % 2 ||
      out->element_count() != x.element_count() || m.gate_up.count < 1)
    return ffi::Error::InvalidArgument("moe_experts: shapes do not agree");
  m.tokens = xd[0], m.k = id[1], m.x = x.typed_data(), m.ids = ids.typed_data();
  m.weights = weights.typed_data(), m.out = out->typed_data();
  motet_qmatmul::moe_experts(m, chosen().impl, chosen().swiglu, on_pool(threads));
  return ffi::Error::Success();
}

// The caches' element type (qmatmul.h's Elem), or -1 where K and V differ or it is none.
int cache_elem(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v) {
  if (k.element_type() != v.element_type()) return -1;
  switch (k.element_type()) {
    case ffi::DataType::F32: return motet_qmatmul::F32;
    case ffi::DataType::F16: return motet_qmatmul::F16;
    case ffi::DataType::BF16: return motet_qmatmul::BF16;
    case ffi::DataType::S8: return motet_qmatmul::I8;
    case ffi::DataType::U8: return motet_qmatmul::E4M3;  // kv_quant.py keeps fp8 as its bit patterns
    default: return -1;
  }
}

#define CACHE_TYPES(name) name ": the caches are not both float32, float16, bfloat16, int8 or uint8 (fp8 e4m3)"

// An 8-bit cache's scales hold `count` floats each (a float cache's are not read).
bool scales_fit(int elem, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v, int64_t count) {
  return !motet_qmatmul::scaled(elem) ||
         (static_cast<int64_t>(k.element_count()) == count && static_cast<int64_t>(v.element_count()) == count);
}

// Decode attention (qmatmul.h's Attention): q [rows, kv_heads, group, head_dim], the
// rows' new K and V [rows, kv_heads, head_dim], the caches (K in blocks of KEY_BLOCK
// positions, [slots, kv_heads, blocks, head_dim, KEY_BLOCK]) and their scales (any size
// under a float cache), slots and positions [rows].
ffi::Error AttendRows(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                      ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                      ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                      ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> positions,
                      ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 4) return ffi::Error::InvalidArgument("attend_rows: bad ranks");
  const int64_t rows = qd[0], heads = qd[1], group = qd[2], hd = qd[3];
  const int64_t cached = kd[0], capacity = kd[2] * kd[4];
  if (kd[1] != heads || kd[3] != hd || kd[4] != motet_qmatmul::KEY_BLOCK || vd[0] != cached || vd[1] != heads || vd[2] != capacity ||
      vd[3] != hd || static_cast<int64_t>(k_new.element_count()) != rows * heads * hd ||
      v_new.element_count() != k_new.element_count() || static_cast<int64_t>(slots.element_count()) != rows ||
      positions.element_count() != slots.element_count() || out->element_count() != q.element_count() ||
      cached < 1)
    return ffi::Error::InvalidArgument("attend_rows: shapes do not agree");
  const int elem = cache_elem(k_cache, v_cache);
  if (elem < 0) return ffi::Error::InvalidArgument(CACHE_TYPES("attend_rows"));
  if (!scales_fit(elem, k_scales, v_scales, cached * heads * capacity))
    return ffi::Error::InvalidArgument("attend_rows: an 8-bit cache's scales are not [slots, kv_heads, capacity]");
  const motet_qmatmul::Attention a{rows, heads, group, hd, cached, capacity, scale,
                                   q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                                   k_cache.untyped_data(), v_cache.untyped_data(), elem,
                                   k_scales.typed_data(), v_scales.typed_data(), slots.typed_data(),
                                   positions.typed_data(), out->typed_data()};
  chosen().attend(a, on_pool(threads));
  return ffi::Error::Success();
}

// Prefill attention (qmatmul.h's ChunkAttention): q [tokens, kv_heads, group, head_dim],
// the chunk's K [kv_heads, head_dim, tokens] and V [kv_heads, tokens, head_dim], the
// caches and their scales (read where has_history), slot and offset (one int32 each).
ffi::Error AttendChunk(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_chunk,
                       ffi::Buffer<ffi::F32> v_chunk, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                       ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> slot,
                       ffi::Buffer<ffi::S32> offset, ffi::ResultBuffer<ffi::F32> out,
                       float scale, int64_t has_history) {
  const auto qd = q.dimensions(), kd = k_chunk.dimensions(), vd = v_chunk.dimensions();
  const auto cd = k_cache.dimensions(), cv = v_cache.dimensions();
  if (qd.size() != 4 || kd.size() != 3 || vd.size() != 3 || cd.size() != 5 || cv.size() != 4)
    return ffi::Error::InvalidArgument("attend_chunk: bad ranks");
  const int64_t t = qd[0], heads = qd[1], group = qd[2], hd = qd[3], capacity = cd[2] * cd[4];
  if (kd[0] != heads || kd[1] != hd || kd[2] != t || vd[0] != heads || vd[1] != t || vd[2] != hd ||
      slot.element_count() != 1 || offset.element_count() != 1 || out->element_count() != q.element_count() ||
      (has_history && (cd[0] < 1 || cd[1] != heads || cd[3] != hd || cd[4] != motet_qmatmul::KEY_BLOCK ||
                       cv[0] != cd[0] || cv[1] != heads || cv[2] != capacity || cv[3] != hd)))
    return ffi::Error::InvalidArgument("attend_chunk: shapes do not agree");
  const int elem = cache_elem(k_cache, v_cache);
  if (elem < 0) return ffi::Error::InvalidArgument(CACHE_TYPES("attend_chunk"));
  if (has_history && !scales_fit(elem, k_scales, v_scales, cd[0] * heads * capacity))
    return ffi::Error::InvalidArgument("attend_chunk: an 8-bit cache's scales are not [slots, kv_heads, capacity]");
  const motet_qmatmul::ChunkAttention a{t, heads, group, hd, cd[0], capacity, scale,
                                        q.typed_data(), k_chunk.typed_data(), v_chunk.typed_data(),
                                        has_history ? k_cache.untyped_data() : nullptr,
                                        has_history ? v_cache.untyped_data() : nullptr, elem,
                                        k_scales.typed_data(), v_scales.typed_data(),
                                        slot.typed_data()[0], offset.typed_data()[0], out->typed_data()};
  chosen().attend_chunk(a, on_pool(threads));
  return ffi::Error::Success();
}

// The bindings' shared parts. A quantized matrix (Matrix): its five buffers, and its
// attributes under `prefix`.
template <typename Binding>
auto matrix_buffers(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>();
}

template <typename Binding>
auto matrix_attributes(Binding binding, const std::string& prefix) {
  return std::move(binding)
      .template Attr<int64_t>(prefix + "kind")
      .template Attr<int64_t>(prefix + "block")
      .template Attr<int64_t>(prefix + "has_min")
      .template Attr<int64_t>(prefix + "group")
      .template Attr<int64_t>(prefix + "x_bits");
}

// Attention, decode or prefill: q, the new rows' (or the chunk's) K and V, the caches,
// slots and positions (or slot and offset), the queries' scale.
auto attention_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<float>("scale");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetQMatmul, QMatmul,
                              matrix_attributes(matrix_buffers(ffi::Ffi::Bind()
                                                                   .Ctx<ffi::ThreadPool>()
                                                                   .Arg<ffi::Buffer<ffi::F32>>())
                                                    .Ret<ffi::Buffer<ffi::F32>>(),
                                                ""));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetQMatmulStacked, QMatmulStacked,
                              matrix_attributes(matrix_buffers(ffi::Ffi::Bind()
                                                                   .Ctx<ffi::ThreadPool>()
                                                                   .Arg<ffi::Buffer<ffi::F32>>())
                                                    .Arg<ffi::Buffer<ffi::S32>>()
                                                    .Ret<ffi::Buffer<ffi::F32>>(),
                                                ""));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetAttendRows, AttendRows, attention_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetAttendChunk, AttendChunk, attention_binding().Attr<int64_t>("has_history"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetMoeExperts, MoeExperts,
                              matrix_attributes(matrix_attributes(matrix_buffers(matrix_buffers(
                                                                      ffi::Ffi::Bind()
                                                                          .Ctx<ffi::ThreadPool>()
                                                                          .Arg<ffi::Buffer<ffi::F32>>()
                                                                          .Arg<ffi::Buffer<ffi::S32>>()
                                                                          .Arg<ffi::Buffer<ffi::F32>>()))
                                                                      .Ret<ffi::Buffer<ffi::F32>>(),
                                                                  "gu_"),
                                                "down_"));

int motet_qmatmul::avx512_rows_at_once() {
#if defined(__x86_64__)
  static const int by_vendor = (__builtin_cpu_init(), __builtin_cpu_is("amd") ? 1 : 4);
#else
  static const int by_vendor = 4;
#endif
  const int rows = rows_at_once.load(std::memory_order_relaxed);
  return rows > 0 ? rows : by_vendor;
}

extern "C" {
// Weight rows the AVX-512 one-row dots take a pass: 1 or 4 from now on (0: as the CPU's
// vendor says). Returns the number in effect.
int motet_qmatmul_rows_at_once(int rows) {
  if (rows == 0 || rows == 1 || rows == 4) rows_at_once.store(rows, std::memory_order_relaxed);
  return motet_qmatmul::avx512_rows_at_once();
}

// The instruction set the kernels use ("avx512vnni", "avx512", "avx2" or "base").
const char* motet_qmatmul_isa() { return chosen().name; }

// Use `name` instead, for tests that compare every instruction set this CPU has;
// returns 0 where the CPU lacks it.
int motet_qmatmul_select(const char* name) {
  const Choice best = best_for_this_cpu();
  const char* order[] = {"avx512vnni", "avx512", "avx2", "base"};
  bool reachable = false;
  for (const char* isa : order) {
    if (std::strcmp(isa, best.name) == 0) reachable = true;
    if (reachable && std::strcmp(isa, name) == 0) {
#if defined(__x86_64__)
      if (std::strcmp(name, "avx512vnni") == 0) chosen() = MOTET_CHOICE(avx512vnni, ALL_PANELS);
      else if (std::strcmp(name, "avx512") == 0) chosen() = MOTET_CHOICE(avx512, NO_PANELS);
      else if (std::strcmp(name, "avx2") == 0) chosen() = MOTET_CHOICE(avx2, SMALL_PANELS);
      else
#endif
        chosen() = MOTET_CHOICE(base, NO_PANELS);
      return 1;
    }
  }
  return 0;
}
}
