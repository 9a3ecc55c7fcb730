// The pread engine: a fixed pool of worker threads sharing one queue of jobs.
//
// A job is one Execute call: a span of requests plus the bookkeeping to hand them out one at a
// time. Workers take the job at the front of the queue, claim its next request and move the job to
// the back, so concurrent Execute calls share the workers round-robin instead of the first caller
// starving the others. A job leaves the queue when its last request has been claimed or when one
// of its requests failed; Execute returns once its job has left the queue and no worker is still
// running one of its requests (the destinations and files belong to the caller, so no worker may
// touch them after Execute returns).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "io/read_engine.h"

namespace tensorferry::io {
namespace {

class PreadEngine final : public ReadEngine {
 public:
  PreadEngine() = default;
  ~PreadEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
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
    if (requests.empty()) return Status::Ok();
    Job job(requests);
    std::unique_lock<std::mutex> lock(mu_);
    queue_.push_back(&job);
    job.queued = true;
    // Wake as many workers as there are requests to hand out; notify_all when that is everyone.
    if (requests.size() >= workers_.size()) {
      work_cv_.notify_all();
    } else {
      for (size_t i = 0; i < requests.size(); ++i) work_cv_.notify_one();
    }
    job.done_cv.wait(lock, [&job] { return !job.queued && job.running == 0; });
    return job.error;
  }

  EngineStats stats() const override {
    EngineStats s;
    s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
    s.requests = requests_.load(std::memory_order_relaxed);
    s.read_calls = read_calls_.load(std::memory_order_relaxed);
    return s;
  }

  std::string_view name() const override { return "pread"; }

 private:
  // Lives on the stack of its Execute call; every field but `requests` is guarded by mu_.
  struct Job {
    explicit Job(std::span<const ReadRequest> r) : requests(r) {}
    std::span<const ReadRequest> requests;
    size_t next = 0;      // index of the next request to hand out
    size_t running = 0;   // requests claimed by a worker and not finished
    bool queued = false;  // still in queue_ (requests left to hand out, no failure yet)
    Status error;         // the first failure
    std::condition_variable done_cv;
  };

  void WorkerLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      // Execute blocks until its job is finished, so the queue is empty whenever the engine is
      // destroyed by a well-behaved owner; stop_ alone ends the loop.
      if (queue_.empty()) return;
      Job* job = queue_.front();
      queue_.pop_front();
      const ReadRequest& request = job->requests[job->next++];
      ++job->running;
      if (job->next < job->requests.size()) {
        queue_.push_back(job);  // round-robin between concurrent jobs
      } else {
        job->queued = false;
      }

      lock.unlock();
      Status status = ReadOne(request);
      lock.lock();

      --job->running;
      if (!status.ok() && job->error.ok()) {
        job->error = std::move(status);
        if (job->queued) {
          // Stop handing out this job's remaining requests.
          queue_.erase(std::find(queue_.begin(), queue_.end(), job));
          job->queued = false;
        }
      }
      // Notified under the lock: the waiter cannot return (and destroy the Job) before we let go.
      if (!job->queued && job->running == 0) job->done_cv.notify_all();
    }
  }

  // Reads the whole destination of one request, continuing short reads.
  Status ReadOne(const ReadRequest& request) {
    requests_.fetch_add(1, std::memory_order_relaxed);
    if (request.dst.empty()) return Status::Ok();
    if (request.file == nullptr) {
      return Status(Code::kInvalidArgument,
                    "read request at offset " + std::to_string(request.offset) + " has no file");
    }
    const RandomAccessFile& file = *request.file;
    const size_t wanted = request.dst.size();
    size_t done = 0;
    while (done < wanted) {
      auto n = file.Read(request.offset + done, request.dst.subspan(done));
      read_calls_.fetch_add(1, std::memory_order_relaxed);
      if (!n.ok()) return n.status();
      if (*n == 0) {
        return Status(Code::kUnexpectedEof,
                      file.path() + ": unexpected end of file at offset " +
                          std::to_string(request.offset + done) + ": wanted " +
                          std::to_string(wanted) + " bytes at offset " +
                          std::to_string(request.offset) + ", got " + std::to_string(done));
      }
      if (*n > wanted - done) {
        // A Read that claims more than it was given would have written past the destination.
        return Status(Code::kInternal, file.path() + ": read at offset " +
                                           std::to_string(request.offset + done) + " returned " +
                                           std::to_string(*n) + " bytes for a " +
                                           std::to_string(wanted - done) + "-byte buffer");
      }
      done += *n;
      bytes_read_.fetch_add(*n, std::memory_order_relaxed);
    }
    return Status::Ok();
  }

  std::mutex mu_;
  std::condition_variable work_cv_;  // a job was queued, or stop_
  std::deque<Job*> queue_;           // jobs with requests left to hand out
  bool stop_ = false;
  std::vector<std::thread> workers_;  // written only by Start, before any Execute

  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> read_calls_{0};
};

}  // namespace

Result<std::unique_ptr<ReadEngine>> MakePreadEngine(unsigned threads) {
  if (threads == 0) {
    const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
    threads = online > 0 ? static_cast<unsigned>(online) : 1;
  }
  auto engine = std::make_unique<PreadEngine>();
  const Status status = engine->Start(threads);
  if (!status.ok()) return status;
  return std::unique_ptr<ReadEngine>(std::move(engine));
}

}  // namespace tensorferry::io
