// The pread engine: a fixed pool of worker threads taking requests from one JobQueue and reading
// each synchronously (pread; pread on the O_DIRECT descriptor for the aligned middle of direct
// ones).
#include <unistd.h>

#include <algorithm>
#include <system_error>
#include <thread>
#include <vector>

#include "io/engine_common.h"
#include "tensorferry/options.h"

namespace tensorferry::io {
namespace {

class PreadEngine final : public ReadEngine {
 public:
  PreadEngine() = default;
  ~PreadEngine() override {
    queue_.Stop();
    for (std::thread& t : workers_) t.join();
  }
  PreadEngine(const PreadEngine&) = delete;
  PreadEngine& operator=(const PreadEngine&) = delete;

  // Starts `threads` workers. On failure the ones already started are joined by the destructor.
  Status Start(unsigned threads) {
    workers_.reserve(threads);
    for (unsigned i = 0; i < threads; ++i) {
      try {
        workers_.emplace_back([this] { WorkerLoop(); });
      } catch (const std::system_error& e) {
        return Status(Code::kIoError, "pread engine: cannot start worker thread " +
                                          std::to_string(i) + " of " + std::to_string(threads) +
                                          ": " + e.what());
      }
    }
    return Status::Ok();
  }

  Status Execute(std::span<const ReadRequest> requests) override {
    return queue_.Run(requests, workers_.size());
  }

  EngineStats stats() const override { return counters_.Snapshot(); }
  std::string_view name() const override { return "pread"; }

 private:
  void WorkerLoop() {
    while (auto claim = queue_.Take(/*wait=*/true)) {
      queue_.Finish(*claim, ReadRequestSync(*claim->request, counters_));
    }
  }

  JobQueue queue_;
  std::vector<std::thread> workers_;  // written only by Start, before any Execute
  EngineCounters counters_;
};

}  // namespace

Result<std::unique_ptr<ReadEngine>> MakePreadEngine(unsigned threads) {
  if (threads == 0) threads = std::max(OnlineCpus(), kPreadMinThreads);
  auto engine = std::make_unique<PreadEngine>();
  const Status status = engine->Start(threads);
  if (!status.ok()) return status;
  return std::unique_ptr<ReadEngine>(std::move(engine));
}

}  // namespace tensorferry::io
