// A batch's next tokens drawn from its logits, each row by its own temperature, top-k,
// top-p and min-p (sampling.py's `sample`, whose XLA form this matches draw for draw).
// XLA:CPU sorted the whole vocabulary for a top-k or top-p cut: 10-13 ms a row at a
// vocabulary of 49152, 150-190 ms for 16 rows, and every compiled step carried the
// sampler's own kernels. Here a cut counts a row's values into bins and sorts or selects
// only within the bin where it falls, and a row costs a few passes over its logits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "qmatmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTop = 5;  // sampling.TOP_CANDIDATES
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Eight floats at a time (GCC's vector extension: AVX where the CPU has it, two SSE
// halves where not), so a row's passes run as vectors without -ffast-math.
typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));

F8 load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// e^x for x <= 0 (a logit less its row's largest): 0 below e^-87 and for -inf, else
// within a few units of the last place (a polynomial on x less its nearest multiple of
// ln 2, times that power of two built from its bits).
inline F8 exp_nonpositive(F8 x) {
  F8 t = x * 1.44269504088896341f;
  t = t < -126.0f ? F8{} - 126.0f : t;
  const I8 k = __builtin_convertvector(0.5f - t, I8);  // round(-t), t <= 0
  const F8 n = -__builtin_convertvector(k, F8);
  F8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F8 p = F8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const F8 e = (p * r * r + r) + 1.0f;
  const F8 scale = (F8)((127 - k) << 23);  // the same bits as floats
  return x < -87.0f ? F8{} : e * scale;
}

float exp_nonpositive(float x) {
  float lanes[8] = {x, 0, 0, 0, 0, 0, 0, 0};
  const F8 e = exp_nonpositive(load8(lanes));
  return e[0];
}

__attribute__((target_clones("avx2", "default"))) float row_max(const float* x, int64_t n) {
  F8 m = F8{} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const F8 v = load8(x + i);
    m = v > m ? v : m;
  }
  float best = kNegInf;
  for (int j = 0; j < 8; ++j) best = std::max(best, m[j]);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// The sum of e^(x - m) over a row: eight lanes in float over blocks of 512, the blocks
// added in double.
__attribute__((target_clones("avx2", "default"))) double sum_exp(const float* x, int64_t n, float m) {
  double sum = 0.0;
  int64_t i = 0;
  while (i + 8 <= n) {
    F8 part{};
    for (const int64_t end = std::min(n, i + 512); i + 8 <= end; i += 8) part += exp_nonpositive(load8(x + i) - m);
    for (int j = 0; j < 8; ++j) sum += part[j];
  }
  for (; i < n; ++i) sum += exp_nonpositive(x[i] - m);
  return sum;
}

// w = e^(x - m) where x >= floor, else 0: a row's unnormalized probabilities after a cut.
__attribute__((target_clones("avx2", "default"))) void weights(const float* x, int64_t n, float m, float floor,
                                                               float* w) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const F8 v = load8(x + i);
    const F8 e = v >= floor ? exp_nonpositive(v - m) : F8{};
    std::memcpy(w + i, &e, sizeof e);
  }
  for (; i < n; ++i) w[i] = x[i] >= floor ? exp_nonpositive(x[i] - m) : 0.0f;
}

// The first position of the row's largest value.
int64_t first_max(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // no value compares (NaNs)
}

struct Batch {
  const float *logits, *scores, *temperature, *top_p, *min_p, *uniform;
  const int32_t* top_k;
  bool want_top;
  int64_t vocab;
  int32_t *token, *top_ids;
  float *logprob, *top_logprob;
};

// A row's values in bins a sixteenth of a unit wide, from its largest value m down;
// the last bin takes everything past 96 units (where every weight is 0), -inf and NaN.
constexpr int64_t kBins = 1536;

inline int64_t bin_of(float m, float x) {
  const float at = (m - x) * 16.0f;
  return at < static_cast<float>(kBins - 1) ? static_cast<int64_t>(at) : kBins - 1;
}

// The k-th largest of a row's values x (whose largest is m): the bin that holds it found
// by counting, then a selection among that bin's values only.
float kth_largest(const float* x, int64_t n, float m, int64_t k) {
  thread_local std::vector<int64_t> count;
  thread_local std::vector<float> scratch;
  count.assign(kBins, 0);
  for (int64_t i = 0; i < n; ++i) ++count[bin_of(m, x[i])];
  int64_t edge = 0, above = 0;
  while (above + count[edge] < k) above += count[edge++];
  scratch.clear();
  for (int64_t i = 0; i < n; ++i)
    if (bin_of(m, x[i]) == edge) scratch.push_back(x[i]);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1 - above), scratch.end(), std::greater<float>());
  return scratch[k - 1 - above];
}

// The nucleus of a row's weights w (of its values x, whose largest is m): its likeliest
// tokens in order (the lower id first among equals) while the mass before each is under
// top_p, the first always. Its size, its tokens first in `order`, in the vocabulary's
// order. Every token of a bin before the one where the running mass reaches top_p is in
// the nucleus, none after it is, and only that bin's tokens are sorted.
int64_t nucleus(const float* x, const float* w, int64_t n, float m, float top_p, std::vector<int32_t>& order) {
  thread_local std::vector<double> mass;
  mass.assign(kBins, 0.0);
  auto bin = [&](int64_t i) { return bin_of(m, x[i]); };
  double z = 0.0;
  for (int64_t i = 0; i < n; ++i)
    if (w[i] > 0.0f) {
      mass[bin(i)] += w[i];
      z += w[i];
    }
  int64_t edge = 0;
  double before = 0.0;
  while (edge < kBins - 1 && (before + mass[edge]) / z < top_p) before += mass[edge++];
  order.clear();
  for (int64_t i = 0; i < n; ++i)
    if (w[i] > 0.0f && bin(i) < edge) order.push_back(static_cast<int32_t>(i));
  const int64_t inside = static_cast<int64_t>(order.size());
  for (int64_t i = 0; i < n; ++i)
    if (w[i] > 0.0f && bin(i) == edge) order.push_back(static_cast<int32_t>(i));
  std::sort(order.begin() + inside, order.end(),
            [&](int32_t a, int32_t c) { return x[a] > x[c] || (x[a] == x[c] && a < c); });
  int64_t kept = static_cast<int64_t>(order.size());
  for (int64_t j = inside; j < kept; ++j) {
    if (j > 0 && before / z >= top_p) {
      kept = j;
      break;
    }
    before += w[order[j]];
  }
  std::sort(order.begin(), order.begin() + kept);
  return kept;
}

// One sampled row's token: its scores over its temperature, cut to its top k (ties with
// the k-th kept), then to its nucleus (the likeliest tokens, in order, while the mass
// before each is under top_p; the first always), then to the tokens at least min_p
// times as likely as its likeliest; drawn by `u` in [0, 1) as the first token, in the
// vocabulary's order, whose running mass passes u times the kept mass.
int64_t draw(const Batch& b, int64_t row, std::vector<float>& x, std::vector<float>& w, std::vector<int32_t>& order) {
  const int64_t n = b.vocab;
  const float* s = b.scores + row * n;
  const float t = std::max(b.temperature[row], 1e-6f);
  x.resize(n);
  w.resize(n);
  for (int64_t i = 0; i < n; ++i) x[i] = s[i] / t;
  const float m = row_max(x.data(), n);
  if (!(m > kNegInf)) return first_max(s, n);
  float floor = kNegInf;  // the top-k cut, as the least value kept
  const int64_t k = b.top_k[row];
  if (k > 0 && k < n) floor = kth_largest(x.data(), n, m, k);
  weights(x.data(), n, m, floor, w.data());
  int64_t kept = -1;  // the nucleus's size, its tokens first in `order` (-1: no nucleus cut)
  if (b.top_p[row] < 1.0f) kept = nucleus(x.data(), w.data(), n, m, b.top_p[row], order);
  const float min_p_floor = b.min_p[row] > 0.0f ? m + std::log(b.min_p[row]) : kNegInf;
  auto weight = [&](int64_t i) { return x[i] >= min_p_floor ? w[i] : 0.0f; };
  const int64_t count = kept >= 0 ? kept : n;
  auto token = [&](int64_t j) -> int64_t { return kept >= 0 ? order[j] : j; };
  double total = 0.0;
  for (int64_t j = 0; j < count; ++j) total += weight(token(j));
  const double target = static_cast<double>(b.uniform[row]) * total;
  double running = 0.0;
  int64_t last = -1;
  for (int64_t j = 0; j < count; ++j) {
    const float p = weight(token(j));
    if (p <= 0.0f) continue;
    running += p;
    last = token(j);
    if (running > target) return last;
  }
  return last >= 0 ? last : first_max(s, n);  // rounding left the target past the end
}

void sample_row(const Batch& b, int64_t row) {
  thread_local std::vector<float> x, w;
  thread_local std::vector<int32_t> order;
  const int64_t n = b.vocab;
  const float* logits = b.logits + row * n;
  const float top = row_max(logits, n);
  const float log_total = top + static_cast<float>(std::log(sum_exp(logits, n, top)));
  const int64_t token = b.temperature[row] > 0.0f ? draw(b, row, x, w, order) : first_max(b.scores + row * n, n);
  b.token[row] = static_cast<int32_t>(token);
  b.logprob[row] = logits[token] - log_total;
  int32_t* ids = b.top_ids + row * kTop;
  float* lp = b.top_logprob + row * kTop;
  std::fill(ids, ids + kTop, 0);
  std::fill(lp, lp + kTop, 0.0f);
  if (!b.want_top) return;
  // the kTop largest logits, largest first, the lower id first among equals
  int64_t best[kTop];
  int64_t have = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (have == kTop && !(logits[i] > logits[best[kTop - 1]])) continue;
    int64_t at = have < kTop ? have++ : kTop - 1;
    while (at > 0 && logits[i] > logits[best[at - 1]]) {
      best[at] = best[at - 1];
      --at;
    }
    best[at] = i;
  }
  for (int64_t j = 0; j < have; ++j) {
    ids[j] = static_cast<int32_t>(best[j]);
    lp[j] = logits[best[j]] - log_total;
  }
}

ffi::Error Sample(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> scores,
                  ffi::Buffer<ffi::F32> temperature, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::S32> top_k,
                  ffi::Buffer<ffi::F32> min_p, ffi::Buffer<ffi::F32> uniform, ffi::Buffer<ffi::PRED> want_top,
                  ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::F32> logprob,
                  ffi::ResultBuffer<ffi::S32> top_ids, ffi::ResultBuffer<ffi::F32> top_logprob) {
  const auto d = logits.dimensions();
  const auto ds = scores.dimensions();
  if (d.size() != 2 || ds.size() != 2 || ds[0] != d[0] || ds[1] != d[1])
    return ffi::Error::InvalidArgument("sample: logits and scores must both be [rows, vocab]");
  const int64_t rows = d[0];
  for (auto per_row : {temperature.element_count(), top_p.element_count(), min_p.element_count(),
                       uniform.element_count(), top_k.element_count()})
    if (static_cast<int64_t>(per_row) != rows) return ffi::Error::InvalidArgument("sample: one value a row");
  Batch b{logits.typed_data(), scores.typed_data(), temperature.typed_data(), top_p.typed_data(),
          min_p.typed_data(), uniform.typed_data(), top_k.typed_data(), want_top.typed_data()[0], d[1],
          token->typed_data(), top_ids->typed_data(), logprob->typed_data(), top_logprob->typed_data()};
  motet_qmatmul::for_each_on_pool(
      &threads, rows, [](void* arg, int64_t row) { sample_row(*static_cast<Batch*>(arg), row); }, &b);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetSample, Sample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
