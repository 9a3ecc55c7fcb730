// The tensorferry command-line tool: one subcommand per file (inspect.cc, verify.cc, gen.cc),
// shared helpers in util.cc. Uses the public API only.
//
// Exit codes, one rule for every command (README, "The CLI"):
//   0 (kExitOk)    done (doctor: whatever it found; its report is the result);
//   1 (kExitError) failed: an I/O error, invalid input, or an invalid setting of the environment
//                  (a TENSORFERRY_* variable): one line "error: ..." on stderr, or with --json
//                  the command's document with "ok": false (Failed);
//   2 (kExitUsage) the command line is wrong: an unknown command or option, a missing argument, an
//                  option's invalid value, options that contradict each other or the environment:
//                  one line on stderr, also with --json (UsageError). InvalidSetting applies the
//                  rule to a setting by where it came from.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "tensorferry/checkpoint.h"
#include "tensorferry/loader.h"
#include "tensorferry/shard.h"
#include "tensorferry/size.h"
#include "tensorferry/status.h"

namespace tensorferry::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;
inline constexpr int kExitUsage = 2;

// A registered subcommand and what runs it once the command line has been parsed.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

Command AddInspectCommand(CLI::App& parent);
Command AddVerifyCommand(CLI::App& parent);
Command AddGenCommand(CLI::App& parent);
Command AddLoadCommand(CLI::App& parent);
Command AddBenchCommand(CLI::App& parent);
Command AddConvertCommand(CLI::App& parent);
Command AddDoctorCommand(CLI::App& parent);
Command AddReshardCommand(CLI::App& parent);
Command AddChecksumCommand(CLI::App& parent);
Command AddCacheCommand(CLI::App& parent);

// --- helpers (util.cc) ------------------------------------------------------------------------

using tensorferry::FormatBytes;
using tensorferry::ParseSize;

// "1 file", "3 files".
inline std::string Plural(uint64_t n, std::string_view noun) {
  return std::to_string(n) + " " + std::string(noun) + (n == 1 ? "" : "s");
}

// Makes text safe for one terminal line: control characters become \xNN.
std::string OneLine(std::string_view text);

// `path` as the CLI shows it (error lines, --json documents): a URL redacted (RedactUrl: no
// password, no signed link's query), a local path as given.
std::string Shown(std::string_view path);

// The "<path>: <reason>" of an error line: the status message, with `path: ` (Shown) put in front
// unless the message already starts with that path (library messages usually name the file).
std::string ErrorText(std::string_view path, const Status& status);

// A shard spec from a JSON file (shard.h schema); "builtin" and "none" name the built-in specs.
Result<ShardSpec> ReadShardRules(const std::string& path);

// Prints "error: <path>: <reason>" as exactly one line on stderr.
void PrintError(std::string_view path, const Status& status);
// Which of a command's source and output an error is about: the output when its message already
// names it (or a file in or beside it: a temporary, a shard) and not the source, else the source.
const std::string& SubjectOf(const Status& status, const std::string& source,
                             const std::string& output);
void PrintError(std::string_view text);

// Writes `text` plus a newline to stdout and flushes; when stdout failed (e.g. EPIPE, a full
// disk) prints "error: <stdout>: write failed" and returns false, so a truncated --json document
// is reported rather than silently exiting 0.
bool WriteStdout(std::string_view text);

// Prints a command's report (WriteStdout) and gives its exit code: kExitOk, or kExitError when
// stdout failed or `status` (what the report is about) is an error.
int PrintReport(std::string_view report, const Status& status = Status::Ok());

class JsonOut;
// Writes the "error" member of a command's --json document: {"code", "category", "message"},
// the message as ErrorText(path, status) gives it.
void JsonError(JsonOut& j, std::string_view path, const Status& status);
// A command's failure about `path`: with --json (`json`), the document {"path", "ok": false,
// "error"} on stdout (as every --json command answers an error); else the error line on stderr.
// Returns kExitError.
int Failed(bool json, std::string_view path, const Status& status);
// The same for a command that reads `src` and writes `dst` (reshard): the document names both,
// {"src", "dst", "ok": false, "error"}, as convert's does; the error is about `subject`.
int Failed(bool json, std::string_view src, std::string_view dst, std::string_view subject,
           const Status& status);

// A usage error: prints "error: <text>" (one line on stderr, nothing on stdout, also with --json)
// and returns kExitUsage.
int UsageError(std::string_view text);

// Where a setting came from.
enum class Origin {
  kCommandLine,  // a flag's value, or flags that contradict each other or the environment
  kEnvironment,  // a TENSORFERRY_* variable (LoadOptions::FromEnvironment), or several that
                 // contradict each other
};
// Reports an invalid setting and returns the exit code, by the rule of every command: the command
// line's is a usage error (UsageError: kExitUsage); the environment's is a failure of the command
// like an unreadable input (Failed(json, path, status): kExitError, with --json the error
// document), since the command line was right. The CLI's only place that decides between them.
int InvalidSetting(Origin origin, bool json, std::string_view path, const Status& status);

// The positional checkpoint argument (required) of every command that reads a checkpoint.
CLI::Option* AddCheckpointPath(CLI::App& app, std::string& path, const std::string& name = "path");

// Checkpoint::Open with the object-store settings of the environment (TENSORFERRY_OBJECT_*, and
// the AWS_* variables the source reads itself).
Result<std::shared_ptr<const Checkpoint>> OpenCheckpoint(const std::string& path);
// The options OpenCheckpoint opens `path` with: for a URL, the object-store settings of the
// environment (an invalid TENSORFERRY_* variable is an error then, which its callers report with
// Failed: InvalidSetting's rule for the environment); for a local path, defaults.
Result<OpenOptions> OpenOptionsFor(const std::string& path);

// Progress on stderr when it is a terminal (nothing otherwise): "\r[####....] 3/17 warm io_uring"
// by steps, or "\r[####....] 1.2 GB of 4.0 GB, 0.85 GB/s" by bytes. The line is cleared at the end.
class Progress {
 public:
  explicit Progress(size_t total);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void Step(const std::string& what);
  void Bytes(uint64_t done, uint64_t total, double seconds);

 private:
  void Draw(uint64_t done, uint64_t total, const std::string& what);
  size_t total_, done_ = 0;
  bool tty_;
};

// The checksum of `load` (and of tensorferry-mpi's ranks): CRC32C (Castagnoli) of each tensor's
// bytes (hardware where the CPU has SSE4.2), combined by FNV-1a over (name, CRC) in name order as
// 16 hex digits, so the same tensors give the same checksum whatever the engine, batching,
// budget, device or mode. Device tensors are copied back to the host (through `staging`) first.
using TensorSums = std::vector<std::pair<std::string, uint32_t>>;
uint32_t Crc32c(const std::byte* data, size_t n);
Status AppendTensorSums(std::span<const Tensor> tensors, TensorSums& sums,
                        std::vector<std::byte>& staging);
uint64_t CombineTensorSums(TensorSums sums);    // the combination as a number
std::string ChecksumHex(uint64_t checksum);     // as 16 hex digits
std::string CombinedChecksum(TensorSums sums);  // ChecksumHex(CombineTensorSums(sums))

// Threads for hashing a checkpoint's files (checksum, verify, reshard's source check): one per
// CPU, at most 16.
unsigned HashThreads();

// Seconds since `start` on a steady clock.
double SecondsSince(int64_t start_ns);
int64_t NowNs();

}  // namespace tensorferry::cli
