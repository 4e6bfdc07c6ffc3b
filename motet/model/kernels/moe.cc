// A MoE layer's routed experts in one call (qmatmul.h's Experts). XLA:CPU ran the same
// work as dozens of small thunks a layer (a sort, a scatter into blocks, a loop over the
// blocks, a gather back), which set the pace of a MoE decode step; here the assignments
// are grouped by expert with a counting sort, and each expert used multiplies all its
// rows at once with the quantized products.
#include <cmath>
#include <cstring>
#include <vector>

#include "qmatmul.h"

namespace motet_qmatmul {

void moe_experts(const Experts& m, Impl product, const Parallel& parallel) {
  const int64_t d = m.gate_up.first.k, f = m.gate_up.first.n / 2, experts = m.gate_up.count;
  const int64_t assignments = m.tokens * m.k;
  std::memset(m.out, 0, m.tokens * d * sizeof(float));
  // assignments by expert, in their own order within one (as a stable sort): a weight of
  // 0 (a padding row, another pass's expert) contributes nothing and is skipped
  std::vector<int64_t> start(experts + 1, 0), order(assignments);
  auto expert_of = [&](int64_t a) {
    const int64_t e = m.ids[a];
    return e < 0 ? int64_t{0} : (e >= experts ? experts - 1 : e);
  };
  for (int64_t a = 0; a < assignments; ++a)
    if (m.weights[a] != 0.f) ++start[expert_of(a) + 1];
  int64_t widest = 0;
  for (int64_t e = 0; e < experts; ++e) {
    widest = widest > start[e + 1] ? widest : start[e + 1];
    start[e + 1] += start[e];
  }
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t a = 0; a < assignments; ++a)
    if (m.weights[a] != 0.f) order[next[expert_of(a)]++] = a;

  std::vector<float> rows(widest * d), hidden(widest * 2 * f), act(widest * f), ys(widest * d);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = start[e], count = start[e + 1] - first;
    if (count == 0) continue;
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(&rows[i * d], m.x + order[first + i] / m.k * d, d * sizeof(float));
    product(m.gate_up.matrix(e), rows.data(), count, hidden.data(), parallel);
    for (int64_t i = 0; i < count; ++i) {
      const float* gate = &hidden[i * 2 * f];
      for (int64_t j = 0; j < f; ++j) act[i * f + j] = gate[j] / (1.f + std::exp(-gate[j])) * gate[f + j];
    }
    product(m.down.matrix(e), act.data(), count, ys.data(), parallel);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t a = order[first + i];
      float* out = m.out + a / m.k * d;
      const float w = m.weights[a];
      for (int64_t j = 0; j < d; ++j) out[j] += w * ys[i * d + j];
    }
  }
}

}  // namespace motet_qmatmul
