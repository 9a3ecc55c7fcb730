// tensorferry bench PATH: every engine cold and warm against the same-run references of
// docs/benchmarks.md ("How we measure"):
//   - page-cache copy limit: pread of the cached files into an already-touched buffer, one thread
//     per core (the ceiling of a warm load into reused memory);
//   - the same copy with each 512 KiB piece hashed into its checksum right after its pread (the
//     ceiling of a warm load that checks checksums, verify=auto on a checkpoint carrying them:
//     the loads below do, and the report says so);
//   - first-touch cost: writing a freshly mapped buffer of the same size;
//   - single-threaded read of the cached files into a fresh buffer (what naive loaders do);
//   - storage limit: fio, O_DIRECT, 8 MiB blocks, queue depth 32, over the evicted files (an
//     internal O_DIRECT reader when fio is not installed, said so in the output);
// and, per engine, `tensorferry load` in a subprocess (fresh process: fresh memory and its own
// peak RSS): warm into fresh memory (first run), warm into reused buffers (best later run), cold
// (files evicted with posix_fadvise and checked with mincore first). Then the budgeted run.
// Each figure is the median of --runs runs (min and max kept in --json).
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/checkpoint.h"
#include "tensorferry/integrity.h"
#include "tensorferry/loader.h"
#include "tensorferry/object_store.h"
#include "tensorferry/options.h"
#include "tensorferry/residency.h"

extern char** environ;

namespace tensorferry::cli {
namespace {

struct BenchArgs {
  std::string path;
  unsigned runs = 3;
  std::string engines = "pread,io_uring,mmap";
  std::string budget = "256MB";
  bool no_cold = false;
  bool json = false;
};

struct Sample {
  std::vector<double> values;  // GB/s
  double Median() const {
    if (values.empty()) return 0;
    std::vector<double> v = values;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  }
  double Min() const {
    return values.empty() ? 0 : *std::min_element(values.begin(), values.end());
  }
  double Max() const {
    return values.empty() ? 0 : *std::max_element(values.begin(), values.end());
  }
};

// Runs argv, returns its stdout (and exit status through `rc`).
std::string RunCapture(const std::vector<std::string>& argv, int* rc) {
  int fds[2];
  if (::pipe(fds) != 0) {
    *rc = -1;
    return "";
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int err = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  std::string out;
  if (err == 0) {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  if (err != 0 || ::waitpid(pid, &status, 0) < 0) {
    *rc = -1;
    return out;
  }
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return out;
}

// The number after "key": in a JSON document we produced ourselves (flat keys are unique).
// Spaces around the colon are allowed (fio writes them).
double JsonNumber(const std::string& doc, const std::string& key, size_t from = 0) {
  size_t at = doc.find("\"" + key + "\"", from);
  if (at == std::string::npos) return -1;
  at += key.size() + 2;
  while (at < doc.size() && (doc[at] == ' ' || doc[at] == ':')) ++at;
  return std::strtod(doc.c_str() + at, nullptr);
}

std::vector<double> JsonNumbers(const std::string& doc, const std::string& key) {
  std::vector<double> out;
  size_t at = doc.find("\"" + key + "\":[");
  if (at == std::string::npos) return out;
  const char* p = doc.c_str() + at + key.size() + 4;
  while (*p != ']' && *p != '\0') {
    char* end;
    out.push_back(std::strtod(p, &end));
    if (end == p) break;
    p = end;
    if (*p == ',') ++p;
  }
  return out;
}

std::string SelfExe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "tensorferry";
}

// Evicts every file and checks that under 1% of each remains cached.
Status Evict(const std::vector<std::string>& files) {
  for (const std::string& f : files) {
    Status s = DropFromPageCache(f);
    if (!s.ok()) return s;
  }
  for (const std::string& f : files) {
    auto cached = CachedFraction(f);
    if (!cached.ok()) return cached.status();
    if (*cached > 0.01) {
      return Status(Code::kIoError, f + ": still " + std::to_string(*cached * 100) +
                                        "% cached after posix_fadvise(DONTNEED)");
    }
  }
  return Status::Ok();
}

struct Region {
  std::string path;
  uint64_t offset, length;
};

// The piece a verified buffered load reads and hashes at a time (src/io/read_engine.h,
// kLandedPieceBytes: the bench uses the public API only).
constexpr uint64_t kVerifiedPieceBytes = uint64_t{512} << 10;

// pread of every region into dst (which must hold them all) with `threads` threads in 8 MiB
// pieces. With `checksum`, each 8 MiB piece is read kVerifiedPieceBytes at a time and each part
// hashed into the piece's checksum (4 MiB chunks) right after its pread, as a verified load does.
// Returns GB/s.
double ParallelRead(const std::vector<Region>& regions, std::byte* dst, unsigned threads,
                    bool checksum = false) {
  struct Piece {
    int fd;
    uint64_t offset, length;
    std::byte* dst;
  };
  std::vector<int> fds;
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (const Region& r : regions) {
    const int fd = ::open(r.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    fds.push_back(fd);
    for (uint64_t at = 0; at < r.length; at += 8u << 20) {
      const uint64_t n = std::min<uint64_t>(8u << 20, r.length - at);
      pieces.push_back({fd, r.offset + at, n, dst + total + at});
    }
    total += r.length;
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> digests{0};  // keeps the hashing from being optimised away
  auto work = [&] {
    ChecksumBuilder builder(kDefaultChecksumChunkSize);
    for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
      const Piece& p = pieces[i];
      for (uint64_t done = 0; done < p.length;) {
        const uint64_t want =
            checksum ? std::min(kVerifiedPieceBytes, p.length - done) : p.length - done;
        const ssize_t n = ::pread(p.fd, p.dst + done, want, static_cast<off_t>(p.offset + done));
        if (n <= 0) break;
        if (checksum) builder.Update({p.dst + done, static_cast<size_t>(n)});
        done += static_cast<uint64_t>(n);
      }
      if (checksum) digests.fetch_xor(builder.Finish().digest, std::memory_order_relaxed);
    }
  };
  const int64_t t0 = NowNs();
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  const double s = SecondsSince(t0);
  for (int fd : fds) ::close(fd);
  return static_cast<double>(total) / s / 1e9;
}

struct Mapping {
  explicit Mapping(uint64_t n) : size(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
    if (data) ::madvise(data, n, MADV_HUGEPAGE);
  }
  ~Mapping() {
    if (data) ::munmap(data, size);
  }
  std::byte* data;
  uint64_t size;
};

// fio over the evicted files, O_DIRECT, 8 MiB blocks (less when a file is smaller: fio refuses a
// block larger than a file), the better of two shapes: one job with queue depth 32 reading the
// files in turn, and one job per file (queue depth 8 each, reported as a group), which is what a
// parallel loader does. GB/s, or -1 when fio is missing or both shapes fail (`*why` says which,
// with fio's exit status).
double FioRead(const std::vector<std::string>& files, std::string* why) {
  auto escape = [](const std::string& f) {
    std::string escaped;
    for (char c : f) {
      if (c == ':') escaped += '\\';
      escaped += c;
    }
    return escaped;
  };
  auto bandwidth = [why](const std::vector<std::string>& argv) {
    int rc = 0;
    const std::string out = RunCapture(argv, &rc);
    if (rc != 0) {
      *why = rc == -1 ? "fio not found" : "fio failed (exit " + std::to_string(rc) + ")";
      return -1.0;
    }
    const size_t read = out.find("\"read\"");
    const double bw = read == std::string::npos ? 0 : JsonNumber(out, "bw_bytes", read);
    if (bw <= 0) *why = "fio reported no read bandwidth";
    return bw > 0 ? bw / 1e9 : -1.0;
  };
  uint64_t smallest = UINT64_MAX;
  for (const std::string& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) == 0) smallest = std::min(smallest, uint64_t(st.st_size));
  }
  const uint64_t block = std::min<uint64_t>(8u << 20, smallest & ~uint64_t{4095});
  if (block == 0) {
    *why = "files too small for fio";
    return -1.0;
  }
  // --readonly: fio must never write the files (given a --size larger than a file, fio would
  // "lay it out", overwriting it). No --size: each file is read whole, as it is.
  const std::vector<std::string> common = {"fio",
                                           "--readonly",
                                           "--rw=read",
                                           "--bs=" + std::to_string(block),
                                           "--ioengine=io_uring",
                                           "--direct=1",
                                           "--output-format=json"};
  std::string names;
  for (const std::string& f : files) names += (names.empty() ? "" : ":") + escape(f);
  std::vector<std::string> one = common;
  one.insert(one.end(), {"--name=seq", "--iodepth=32", "--filename=" + names});
  (void)Evict(files);
  const double single = bandwidth(one);
  std::vector<std::string> per_file = common;
  per_file.insert(per_file.end(), {"--iodepth=8", "--group_reporting"});
  for (size_t i = 0; i < files.size(); ++i) {
    per_file.push_back("--name=f" + std::to_string(i));
    per_file.push_back("--filename=" + escape(files[i]));
  }
  (void)Evict(files);
  const double parallel = bandwidth(per_file);
  return std::max(single, parallel);
}

// The internal stand-in for fio: O_DIRECT reads of 8 MiB, 2 threads per core.
double DirectRead(const std::vector<std::string>& files) {
  struct Piece {
    int fd;
    uint64_t offset;
  };
  std::vector<int> fds;
  std::vector<Piece> pieces;
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) return -1;
    fds.push_back(fd);
    const uint64_t size = static_cast<uint64_t>(::lseek(fd, 0, SEEK_END));
    for (uint64_t at = 0; at < size; at += 8u << 20) pieces.push_back({fd, at});
  }
  const unsigned threads = std::thread::hardware_concurrency() * 2;
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> bytes{0};
  auto work = [&] {
    Mapping buf(8u << 20);
    for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
      const ssize_t n =
          ::pread(pieces[i].fd, buf.data, 8u << 20, static_cast<off_t>(pieces[i].offset));
      if (n > 0) bytes += static_cast<uint64_t>(n);
    }
  };
  const int64_t t0 = NowNs();
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < threads; ++i) pool.emplace_back(work);
  for (std::thread& t : pool) t.join();
  const double s = SecondsSince(t0);
  for (int fd : fds) ::close(fd);
  return static_cast<double>(bytes.load()) / s / 1e9;
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

uint64_t MemTotal() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  f >> key >> kb;
  return kb * 1024;
}

// What the bench measured: throughput samples, memory figures and notes, by name.
struct BenchResults {
  std::map<std::string, Sample> results;
  std::map<std::string, uint64_t> memory;
  std::vector<std::string> notes;
  bool verified_note = false;       // the note that the loads checked checksums is in `notes`
  std::vector<std::string> failed;  // the loads that failed (the bench then fails: exit 1)
};

// The bench's outcome: an error naming the loads that failed, if any did (a checksum mismatch, a
// budget smaller than a tensor: their rows are missing from the report).
Status BenchStatus(const BenchResults& out) {
  if (out.failed.empty()) return Status::Ok();
  std::string text = std::to_string(out.failed.size()) + " of the measured loads failed (";
  for (size_t i = 0; i < out.failed.size(); ++i) text += (i ? "; " : "") + out.failed[i];
  return Status(Code::kIoError, text +
                                    "): their figures are missing; run them with `tensorferry "
                                    "load` to see why");
}

// Checks --engines and --budget as `tensorferry load` will read them (LoadOptions::Set) and
// collects the engines; the error of the first invalid one.
Status CheckLoadFlags(const BenchArgs& args, std::vector<std::string>& engines) {
  LoadOptions checked;
  for (size_t at = 0; at <= args.engines.size();) {
    const size_t comma = std::min(args.engines.find(',', at), args.engines.size());
    const std::string e = args.engines.substr(at, comma - at);
    if (!e.empty()) {
      if (Status s = SetContext(checked, "engine", e, "--engines"); !s.ok()) return s;
      engines.push_back(e);
    }
    at = comma + 1;
  }
  if (engines.empty()) {
    return Status(Code::kInvalidArgument,
                  "--engines " + args.engines + ": names no engine (e.g. pread,io_uring,mmap)");
  }
  if (Status s = SetContext(checked, "budget", args.budget, "--budget"); !s.ok()) return s;
  if (checked.budget == 0) {  // 0 is "unbounded": the budgeted run would compare nothing
    return Status(Code::kInvalidArgument,
                  "--budget " + args.budget + ": the budgeted run needs a budget above 0");
  }
  return Status::Ok();
}

// The hardware references: page-cache copy limit (after warming the files), first touch of
// fresh memory, one thread into fresh memory. Prints the error and returns false if the buffer
// cannot be mapped.
bool RunReferences(const std::vector<Region>& regions, uint64_t total, unsigned runs,
                   unsigned cores, Progress& progress, BenchResults& out) {
  // Warm the files.
  {
    Mapping buf(total);
    if (buf.data == nullptr) {
      PrintError("cannot map " + std::to_string(total) + " bytes for the references");
      return false;
    }
    ParallelRead(regions, buf.data, cores);
    for (unsigned r = 0; r < runs; ++r) {
      // Page-cache copy limit: the buffer is touched (it was read into just before).
      out.results["ref: page-cache copy limit"].values.push_back(
          ParallelRead(regions, buf.data, cores));
      progress.Step("page-cache copy limit");
      // The same copy with each piece hashed as it lands: the most a warm load that checks
      // checksums (verify=auto on a checkpoint that carries them) can reach on this machine.
      out.results["ref: page-cache copy, checksummed"].values.push_back(
          ParallelRead(regions, buf.data, cores, /*checksum=*/true));
      progress.Step("page-cache copy, checksummed");
    }
  }
  for (unsigned r = 0; r < runs; ++r) {
    Mapping fresh(total);
    const int64_t t0 = NowNs();
    for (uint64_t at = 0; at < total; at += 4096) fresh.data[at] = std::byte{1};
    out.results["ref: first touch of fresh memory"].values.push_back(static_cast<double>(total) /
                                                                     SecondsSince(t0) / 1e9);
    progress.Step("first touch");
  }
  for (unsigned r = 0; r < runs; ++r) {
    Mapping fresh(total);
    out.results["ref: 1 thread into fresh memory"].values.push_back(
        ParallelRead(regions, fresh.data, 1));
    progress.Step("single thread, fresh memory");
  }
  return true;
}

// Runs `tensorferry load --json` with `engine` in a child process; its output, or "" (with a
// note) if it failed.
std::string LoadJson(const BenchArgs& args, const std::string& self, const std::string& engine,
                     std::vector<std::string> extra, BenchResults& out) {
  // --touch: every page of every tensor is read by the caller, so lazy views are timed as
  // their users pay for them (docs/benchmarks.md, "what loaded means").
  std::vector<std::string> argv = {self,   "load",          args.path, "--engine",
                                   engine, "--no-checksum", "--touch", "--json"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  int rc = 0;
  std::string json = RunCapture(argv, &rc);
  if (rc != 0) {
    std::string what = "load --engine " + engine;
    for (const std::string& e : extra) what += " " + e;
    out.notes.push_back(what + " failed with exit " + std::to_string(rc));
    out.failed.push_back(what + ": exit " + std::to_string(rc));
    return "";
  }
  return json;
}

// Warm: each engine in its own process, 3 loads each: fresh memory, then reused buffers.
void RunWarm(const BenchArgs& args, const std::string& self,
             const std::vector<std::string>& engines, unsigned runs, Progress& progress,
             BenchResults& out) {
  for (unsigned r = 0; r < runs; ++r) {
    for (const std::string& e : engines) {
      // mmap: one load per process (a second load would find the pages already mapped).
      const bool mapped = e == "mmap";
      const std::string json = LoadJson(args, self, e, {"--repeat", mapped ? "1" : "3"}, out);
      const std::vector<double> gbps = JsonNumbers(json, "runs_gb_per_s");
      if (!gbps.empty()) {
        if (mapped) {
          out.results["warm, zero-copy views, every page touched: mmap"].values.push_back(gbps[0]);
        } else if (gbps.size() == 3) {
          out.results["warm, fresh memory: " + e].values.push_back(gbps[0]);
          out.results["warm, reused buffers: " + e].values.push_back(std::max(gbps[1], gbps[2]));
        }
        out.memory["peak RSS: " + e] = static_cast<uint64_t>(JsonNumber(json, "peak_rss_bytes") -
                                                             JsonNumber(json, "rss_before_bytes"));
        if (JsonNumber(json, "verified_bytes") > 0 && !out.verified_note) {
          out.verified_note = true;
          out.notes.push_back(
              "the loads check the checkpoint's checksums (verify=auto): their warm limit is "
              "'ref: page-cache copy, checksummed'");
        }
      }
      progress.Step("warm " + e);
    }
  }
}

// Budget (warm, auto engine): bytes held and throughput against unbudgeted in the same run.
void RunBudget(const BenchArgs& args, const std::string& self, unsigned runs, Progress& progress,
               BenchResults& out) {
  for (unsigned r = 0; r < runs; ++r) {  // alternated, as every other pair of contenders
    const std::string unbounded = LoadJson(args, self, "auto", {}, out);
    const std::string budgeted = LoadJson(args, self, "auto", {"--budget", args.budget}, out);
    const std::vector<double> u = JsonNumbers(unbounded, "runs_gb_per_s");
    const std::vector<double> b = JsonNumbers(budgeted, "runs_gb_per_s");
    if (!u.empty() && !b.empty()) {
      out.results["warm, unbounded: auto"].values.push_back(u[0]);
      out.results["warm, budget " + args.budget + ": auto"].values.push_back(b[0]);
      // The most any run held over its start.
      uint64_t& held_budget = out.memory["peak RSS over start, budget " + args.budget];
      uint64_t& held_unbounded = out.memory["peak RSS over start, unbounded"];
      held_budget =
          std::max(held_budget, static_cast<uint64_t>(JsonNumber(budgeted, "peak_rss_bytes") -
                                                      JsonNumber(budgeted, "rss_before_bytes")));
      held_unbounded = std::max(held_unbounded,
                                static_cast<uint64_t>(JsonNumber(unbounded, "peak_rss_bytes") -
                                                      JsonNumber(unbounded, "rss_before_bytes")));
    }
    progress.Step("budget");
  }
}

// Cold: each engine after evicting the files, then the storage limit (fio, or the internal
// O_DIRECT reader).
void RunCold(const BenchArgs& args, const std::string& self,
             const std::vector<std::string>& engines, const std::vector<std::string>& files,
             unsigned runs, Progress& progress, BenchResults& out) {
  for (unsigned r = 0; r < runs; ++r) {
    for (const std::string& e : engines) {
      if (Status s = Evict(files); !s.ok()) {
        out.notes.push_back("eviction failed: " + s.message());
      }
      const std::vector<double> gbps =
          JsonNumbers(LoadJson(args, self, e, {}, out), "runs_gb_per_s");
      if (!gbps.empty()) out.results["cold: " + e].values.push_back(gbps[0]);
      progress.Step("cold " + e);
    }
  }
  for (unsigned r = 0; r < runs; ++r) {
    (void)Evict(files);
    std::string why;
    double fio = FioRead(files, &why);
    if (fio < 0) {
      if (r == 0) out.notes.push_back(why + ": storage limit from the internal O_DIRECT reader");
      fio = DirectRead(files);
      if (fio < 0) {  // no O_DIRECT here either (tmpfs before Linux 6.6): no figure, a note
        if (r == 0)
          out.notes.push_back(
              "the internal O_DIRECT reader cannot open the files: no "
              "storage limit measured");
        continue;
      }
      out.results["ref: storage limit (O_DIRECT reader)"].values.push_back(fio);
    } else {
      out.results["ref: storage limit (fio O_DIRECT)"].values.push_back(fio);
    }
  }
  progress.Step("storage limit");
}

// The machine and checkpoint the bench ran on, for the report.
struct BenchContext {
  std::string path;
  uint64_t total = 0;
  uint64_t files = 0;
  uint64_t tensors = 0;
  unsigned runs = 0;
  unsigned cores = 0;
  std::string kernel;
};

// The --json report.
std::string BenchJson(const BenchContext& c, const BenchResults& out) {
  const Status status = BenchStatus(out);
  JsonOut j;
  j.BeginObject()
      .Field("path", Shown(c.path))
      .Field("ok", status.ok())
      .Field("bytes", c.total)
      .Field("files", c.files)
      .Field("tensors", c.tensors)
      .Field("runs", static_cast<uint64_t>(c.runs))
      .Field("cpu", CpuModel())
      .Field("cores", static_cast<uint64_t>(c.cores))
      .Field("memory_bytes", MemTotal())
      .Field("kernel", c.kernel)
      .Key("results")
      .BeginObject();
  for (const auto& [name, s] : out.results) {
    j.Key(name).BeginObject().Field("median_gb_per_s", s.Median()).Field("min", s.Min());
    j.Field("max", s.Max()).EndObject();
  }
  j.EndObject().Key("memory").BeginObject();
  for (const auto& [name, bytes] : out.memory) j.Field(name, bytes);
  j.EndObject().Key("notes").BeginArray();
  for (const std::string& n : out.notes) j.String(n);
  j.EndArray();
  if (!status.ok()) JsonError(j, c.path, status);
  j.EndObject();
  return j.str();
}

// The human-readable report: checkpoint and machine, one line per result, memory, notes.
std::string BenchText(const BenchContext& c, const BenchResults& out) {
  std::string text = "checkpoint " + c.path + ": " + FormatBytes(c.total) + " of tensors in " +
                     Plural(c.files, "file") + "\nmachine: " + CpuModel() + ", " +
                     std::to_string(c.cores) + " cores, " + FormatBytes(MemTotal()) +
                     " RAM, Linux " + c.kernel + "\nmedian of " + std::to_string(c.runs) +
                     " runs (min-max), GB/s:\n";
  for (const auto& [name, s] : out.results) {
    char line[160];
    std::snprintf(line, sizeof line, "  %-44s %7.2f  (%.2f-%.2f)\n", name.c_str(), s.Median(),
                  s.Min(), s.Max());
    text += line;
  }
  for (const auto& [name, bytes] : out.memory) {
    text += "  " + name + ": " + FormatBytes(bytes) + "\n";
  }
  for (const std::string& n : out.notes) text += "note: " + n + "\n";
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

int RunBench(const BenchArgs& args) {
  if (IsObjectUrl(args.path)) {
    // Engines, the page cache and fio are about local storage.
    return UsageError(
        Shown(args.path) +
        ": bench measures local storage (engines, page cache, fio); for a URL "
        "use `tensorferry load URL --repeat N --json` or bench/object_store_bench.py");
  }
  std::vector<std::string> engines;
  if (const Status s = CheckLoadFlags(args, engines); !s.ok()) {
    return InvalidSetting(Origin::kCommandLine, args.json, args.path, s);
  }
  // Every load it runs starts from the environment's settings (LoadOptions::FromEnvironment): an
  // invalid variable would fail them all, leaving a report of references only.
  if (const Result<LoadOptions> env = LoadOptions::FromEnvironment(); !env.ok()) {
    return InvalidSetting(Origin::kEnvironment, args.json, args.path, env.status());
  } else if (const Status valid = env->Validate(); !valid.ok()) {
    // Variables that contradict each other (as load reports them).
    return InvalidSetting(Origin::kEnvironment, args.json, args.path,
                          valid.WithPrefix("TENSORFERRY_* environment variables"));
  }
  Result<std::shared_ptr<const Checkpoint>> checkpoint = OpenCheckpoint(args.path);
  if (!checkpoint.ok()) return Failed(args.json, args.path, checkpoint.status());
  const Checkpoint& ckpt = **checkpoint;
  // An hf:// path not in the local hub cache opens its files on the hub: not local storage.
  if (!ckpt.files().empty() && ckpt.files()[0].path.find("://") != std::string::npos) {
    return UsageError(Shown(args.path) + ": its files are read from " +
                      Shown(ckpt.files()[0].path) +
                      ", not local storage: bench measures local storage (engines, page cache, "
                      "fio); for a remote checkpoint use `tensorferry load PATH --repeat N "
                      "--json`");
  }
  std::vector<std::string> files;
  std::vector<Region> regions;
  uint64_t total = 0;
  for (const FileInfo& f : ckpt.files()) {
    files.push_back(f.path);
    regions.push_back({f.path, f.data_offset, f.file_size - f.data_offset});
    total += f.file_size - f.data_offset;
  }
  if (total == 0) {
    return Failed(args.json, args.path,
                  Status(Code::kInvalidArgument, "the checkpoint holds no tensor data (" +
                                                     Plural(ckpt.tensors().size(), "tensor") +
                                                     " of 0 bytes): nothing to "
                                                     "measure"));
  }
  const unsigned runs = std::max(args.runs, 1u);
  const unsigned cores = std::thread::hardware_concurrency();
  const std::string self = SelfExe();

  Progress progress(4 * runs + engines.size() * (runs + (args.no_cold ? 0 : runs)) +
                    (args.no_cold ? 0 : 1) + runs + 1);
  BenchResults out;
  if (!RunReferences(regions, total, runs, cores, progress, out)) return kExitError;
  RunWarm(args, self, engines, runs, progress, out);
  RunBudget(args, self, runs, progress, out);
  if (!args.no_cold) RunCold(args, self, engines, files, runs, progress, out);
  progress.Step("done");

  utsname u{};
  ::uname(&u);
  const BenchContext c{args.path, total, files.size(),          ckpt.tensors().size(),
                       runs,      cores, std::string(u.release)};
  const Status status = BenchStatus(out);
  if (!status.ok() && !args.json) PrintError(args.path, status);
  return PrintReport(args.json ? BenchJson(c, out) : BenchText(c, out), status);
}

}  // namespace

Command AddBenchCommand(CLI::App& parent) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* app = parent.add_subcommand(
      "bench", "Every engine cold and warm, against same-run hardware references");
  AddCheckpointPath(*app, args->path);
  app->add_option("--runs", args->runs, "Runs per configuration (median reported; default 3)")
      ->check(CLI::Range(1u, 1000000u));
  app->add_option("--engines", args->engines,
                  "Comma-separated engines (default pread,io_uring,mmap)");
  app->add_option("--budget", args->budget, "Budget of the budgeted run (default 256MB)");
  app->add_flag("--no-cold", args->no_cold, "Skip the cold runs (they evict the files)");
  app->add_flag("--json", args->json, "Print one JSON document");
  return {app, [args] { return RunBench(*args); }};
}

}  // namespace tensorferry::cli
