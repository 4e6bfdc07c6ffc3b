// Work shared out over XLA's intra-op threads (qmatmul.h's Parallel): the products,
// attention and experts hand their units here.
#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>

#include "qmatmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace motet_qmatmul {
namespace {

// One product's units, claimed one at a time by the calling thread and by helpers on
// XLA's intra-op pool. The caller alone could run them all, so a helper that starts
// late (its pool busy) is never waited for; it finds nothing left and returns, which is
// why the state is shared with it rather than owned by the caller.
struct Share {
  Task task;
  void* arg;
  int64_t units;
  std::atomic<int64_t> next{0}, done{0};

  void work() {
    for (int64_t unit; (unit = next.fetch_add(1)) < units;) {
      task(arg, unit);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace

void for_each_on_pool(void* pool, int64_t units, Task task, void* arg) {
  auto& threads = *static_cast<ffi::ThreadPool*>(pool);
  auto share = std::make_shared<Share>();
  share->task = task;
  share->arg = arg;
  share->units = units;
  const int64_t helpers = std::min<int64_t>(threads.num_threads(), units) - 1;
  for (int64_t i = 0; i < helpers; ++i) threads.Schedule([share] { share->work(); });
  share->work();
  // the units still running on helpers are each a few microseconds to milliseconds
  for (int spins = 0; share->done.load(std::memory_order_acquire) < units; ++spins)
    if (spins > 1000) std::this_thread::yield();
}

}  // namespace motet_qmatmul
