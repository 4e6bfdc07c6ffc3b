// A MoE layer's routed experts in one call (qmatmul.h's Experts). XLA:CPU ran the same
// work as dozens of small thunks a layer (a sort, a scatter into blocks, a loop over the
// blocks, a gather back), which set the pace of a MoE decode step; here the assignments
// are grouped by expert with a counting sort, and each expert used multiplies all its
// rows at once with the quantized products.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "qmatmul.h"

namespace motet_qmatmul {
namespace {

// Experts run in parallel, each whole on one thread, when each has few rows (one handoff
// a layer instead of two a product) or none holds more than a share of the rows; else
// each product is shared out over the threads, so one long expert does not leave the
// other threads idle. A 512-token prefill of a MoE with 32 experts, top-4 (about 64 rows
// an expert): 32.4 ms a layer with the products shared, 25.1 with the experts (AVX2, 2
// threads; each thread dequantizes its own panels, and no product waits on a handoff).
constexpr int64_t FEW_ROWS = 8;
constexpr int64_t WIDEST_SHARE = 4;  // an expert at most a quarter of the rows

void inline_for_each(void*, int64_t units, Task task, void* arg) {
  for (int64_t unit = 0; unit < units; ++unit) task(arg, unit);
}

// A unit of the activation: ACTIVATION_ROWS rows of an expert's hidden states.
constexpr int64_t ACTIVATION_ROWS = 16;
struct Activation {
  SwigluImpl swiglu;
  const float* hidden;  // [rows, 2f]
  float* out;           // [rows, f]
  int64_t rows, f;
};

void activate(void* arg, int64_t unit) {
  const Activation& a = *static_cast<Activation*>(arg);
  const int64_t first = unit * ACTIVATION_ROWS;
  const int64_t rows = a.rows - first < ACTIVATION_ROWS ? a.rows - first : ACTIVATION_ROWS;
  a.swiglu(a.hidden + first * 2 * a.f, rows, a.f, a.out + first * a.f);
}

// Floats left unset: every one is written before it is read, and zeroing an expert's
// buffers and the outputs took 2% of a prefill's experts on one thread.
std::unique_ptr<float[]> unset_floats(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

struct Plan {
  const Experts& m;
  Impl product;
  SwigluImpl swiglu;
  Parallel inner;                     // how an expert's own products run
  const std::vector<int64_t>& start;  // [experts + 1]: expert e's assignments in order
  const std::vector<int64_t>& order;  // assignments sorted by expert
  std::unique_ptr<float[]> ys;        // [sorted assignments, d]: each one's output
  std::vector<int64_t> by_rows;       // the order the experts are taken in (empty: 0, 1, ...)
};

// Expert e's rows: gathered, through gate_up, swiglu and down, into plan.ys.
void run_expert(void* arg, int64_t unit) {
  Plan& plan = *static_cast<Plan*>(arg);
  const int64_t e = plan.by_rows.empty() ? unit : plan.by_rows[unit];
  const Experts& m = plan.m;
  const int64_t first = plan.start[e], count = plan.start[e + 1] - first;
  if (count == 0) return;
  const int64_t d = m.gate_up.first.k, f = m.gate_up.first.n / 2;
  const auto rows = unset_floats(count * d), hidden = unset_floats(count * 2 * f), act = unset_floats(count * f);
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(&rows[i * d], m.x + plan.order[first + i] / m.k * d, d * sizeof(float));
  plan.product(m.gate_up.matrix(e), rows.get(), count, hidden.get(), plan.inner);
  Activation activation{plan.swiglu, hidden.get(), act.get(), count, f};
  plan.inner.for_each(plan.inner.pool, (count + ACTIVATION_ROWS - 1) / ACTIVATION_ROWS, activate, &activation);
  plan.product(m.down.matrix(e), act.get(), count, &plan.ys[first * d], plan.inner);
}

// Tokens a unit of the weighted sum takes (a decode step's few run on the caller).
constexpr int64_t SUM_TOKENS = 32;
struct WeightedSum {
  const Experts& m;
  const float* ys;
  const std::vector<int64_t>& sorted_at;  // [assignments]: where each lies in the sorted order, or -1
};

// out[t] = Σ weight · y over token t's assignments, added in their sorted order, as
// XLA's grouped loop adds them, so each token's sum has the same bits however the
// tokens are shared out.
void weighted_sum(void* arg, int64_t unit) {
  const WeightedSum& s = *static_cast<WeightedSum*>(arg);
  const Experts& m = s.m;
  const int64_t d = m.gate_up.first.k;
  std::vector<int64_t> taken;
  for (int64_t t = unit * SUM_TOKENS; t < std::min(m.tokens, (unit + 1) * SUM_TOKENS); ++t) {
    taken.clear();
    for (int64_t a = t * m.k; a < (t + 1) * m.k; ++a)
      if (s.sorted_at[a] >= 0) taken.push_back(a);
    std::sort(taken.begin(), taken.end(), [&](int64_t a, int64_t b) { return s.sorted_at[a] < s.sorted_at[b]; });
    float* out = m.out + t * d;
    std::memset(out, 0, d * sizeof(float));
    for (const int64_t a : taken) {
      const float w = m.weights[a];
      const float* y = s.ys + s.sorted_at[a] * d;
      for (int64_t j = 0; j < d; ++j) out[j] += w * y[j];
    }
  }
}

}  // namespace

void moe_experts(const Experts& m, Impl product, SwigluImpl swiglu, const Parallel& parallel) {
  const int64_t d = m.gate_up.first.k, f = m.gate_up.first.n / 2, experts = m.gate_up.count;
  const int64_t assignments = m.tokens * m.k;
  // assignments by expert, in their own order within one (as a stable sort): a weight of
  // 0 (a padding row, another pass's expert) contributes nothing and is skipped
  std::vector<int64_t> start(experts + 1, 0), order(assignments);
  auto expert_of = [&](int64_t a) {
    const int64_t e = m.ids[a];
    return e < 0 ? int64_t{0} : (e >= experts ? experts - 1 : e);
  };
  for (int64_t a = 0; a < assignments; ++a)
    if (m.weights[a] != 0.f) ++start[expert_of(a) + 1];
  int64_t widest = 0, used = 0;  // the most rows of one expert; experts with any
  for (int64_t e = 0; e < experts; ++e) {
    widest = widest > start[e + 1] ? widest : start[e + 1];
    used += start[e + 1] > 0;
    start[e + 1] += start[e];
  }
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t a = 0; a < assignments; ++a)
    if (m.weights[a] != 0.f) order[next[expert_of(a)]++] = a;

  Plan plan{m, product, swiglu, parallel, start, order, unset_floats(assignments * d), {}};
  if (used > 1 && (widest <= FEW_ROWS || widest * WIDEST_SHARE <= start[experts])) {
    // the experts with most rows first, so the threads finish near together
    plan.by_rows.resize(experts);
    for (int64_t e = 0; e < experts; ++e) plan.by_rows[e] = e;
    std::stable_sort(plan.by_rows.begin(), plan.by_rows.end(), [&](int64_t a, int64_t b) {
      return start[a + 1] - start[a] > start[b + 1] - start[b];
    });
    plan.inner = Parallel{nullptr, inline_for_each, 1};
    parallel.for_each(parallel.pool, experts, run_expert, &plan);
  } else {
    for (int64_t e = 0; e < experts; ++e) run_expert(&plan, e);
  }
  std::vector<int64_t> sorted_at(assignments, -1);
  for (int64_t i = 0; i < start[experts]; ++i) sorted_at[order[i]] = i;
  WeightedSum sum{m, plan.ys.get(), sorted_at};
  const int64_t units = (m.tokens + SUM_TOKENS - 1) / SUM_TOKENS;
  if (units == 1) weighted_sum(&sum, 0);
  else parallel.for_each(parallel.pool, units, weighted_sum, &sum);
}

}  // namespace motet_qmatmul
