// Helpers shared by the tensorferry subcommands.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "commands.h"
#include "json_out.h"
#include "tensorferry/device.h"
#include "tensorferry/options.h"

namespace tensorferry::cli {

std::string OneLine(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7F) {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    } else {
      out.push_back(ch);
    }
  }
  return out;
}

namespace {

// True when `message` starts with `prefix` followed by ':' or '/' (a path inside it).
bool NamesPathUnder(std::string_view message, std::string_view prefix) {
  if (prefix.empty() || message.size() <= prefix.size() || !message.starts_with(prefix)) {
    return false;
  }
  const char next = message[prefix.size()];
  return next == ':' || next == '/' || prefix.back() == '/';
}

}  // namespace

Result<ShardSpec> ReadShardRules(const std::string& path) {
  if (std::optional<ShardSpec> named = ShardSpec::Named(path)) return std::move(*named);
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status(Code::kNotFound, path + ": cannot open the shard rules file");
  std::ostringstream text;
  text << f.rdbuf();
  auto spec = ShardSpec::FromJson(text.str());
  if (!spec.ok()) return Status(spec.status().code(), path + ": " + spec.status().message());
  return spec;
}

std::string Shown(std::string_view path) {
  return IsObjectUrl(path) ? RedactUrl(path) : std::string(path);
}

std::string ErrorText(std::string_view given, const Status& status) {
  const std::string shown = Shown(given);
  const std::string_view path = shown;
  std::string_view message = status.message();
  if (message.empty()) message = CodeName(status.code());
  // A bad environment variable (LoadOptions::FromEnvironment names it) is not about the path.
  if (message.starts_with("TENSORFERRY_")) return std::string(message);
  // Library messages start with the file they are about: the path given, a file inside that
  // directory, or (for an index or a file given) a sibling in the same directory. Those already
  // have the "<path>: <reason>" shape.
  const auto names = [&](std::string_view p) {
    if (NamesPathUnder(message, p)) return true;
    const size_t slash = p.rfind('/');
    return slash != std::string_view::npos && NamesPathUnder(message, p.substr(0, slash + 1));
  };
  if (names(path)) return std::string(message);
  // A relative local path is named by its absolute form (the library anchors it at open).
  if (const std::string anchored = AnchoredPath(std::string(path));
      anchored != path && names(anchored)) {
    return std::string(message);
  }
  const size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) {
    // A relative file name in the current directory: is the message about a sibling file?
    const size_t colon = message.find(": ");
    if (colon != std::string_view::npos) {
      const std::string_view first = message.substr(0, colon);
      if (first.find('/') == std::string_view::npos && first.ends_with(".safetensors")) {
        return std::string(message);
      }
    }
  }
  std::string out(path);
  out += ": ";
  out += message;
  return out;
}

void PrintError(std::string_view text) {
  std::string line = "error: " + OneLine(text) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

const std::string& SubjectOf(const Status& status, const std::string& source,
                             const std::string& output) {
  const std::string message(status.message());
  return ErrorText(output, status) == message && ErrorText(source, status) != message ? output
                                                                                      : source;
}

void PrintError(std::string_view path, const Status& status) {
  PrintError(ErrorText(path, status));
}

bool WriteStdout(std::string_view text) {
  const bool wrote = std::fwrite(text.data(), 1, text.size(), stdout) == text.size() &&
                     std::fputc('\n', stdout) != EOF;
  if (std::fflush(stdout) == 0 && wrote) return true;
  PrintError("<stdout>: write failed");
  return false;
}

int PrintReport(std::string_view report, const Status& status) {
  return WriteStdout(report) && status.ok() ? kExitOk : kExitError;
}

void JsonError(JsonOut& j, std::string_view path, const Status& status) {
  j.Key("error")
      .BeginObject()
      .Field("code", CodeName(status.code()))
      .Field("category", CategoryName(status.category()))
      .Field("message", ErrorText(path, status))
      .EndObject();
}

namespace {

// Failed's body: `names` writes the members that say what the document is about.
template <typename Names>
int FailedAbout(bool json, std::string_view subject, const Status& status, const Names& names) {
  if (!json) {
    PrintError(subject, status);
    return kExitError;
  }
  JsonOut j;
  j.BeginObject();
  names(j);
  j.Field("ok", false);
  JsonError(j, subject, status);
  j.EndObject();
  return PrintReport(j.str(), status);
}

}  // namespace

int Failed(bool json, std::string_view path, const Status& status) {
  return FailedAbout(json, path, status, [&](JsonOut& j) { j.Field("path", Shown(path)); });
}

int Failed(bool json, std::string_view src, std::string_view dst, std::string_view subject,
           const Status& status) {
  return FailedAbout(json, subject, status,
                     [&](JsonOut& j) { j.Field("src", Shown(src)).Field("dst", Shown(dst)); });
}

int UsageError(std::string_view text) {
  PrintError(text);
  return kExitUsage;
}

int InvalidSetting(Origin origin, bool json, std::string_view path, const Status& status) {
  if (origin == Origin::kCommandLine) return UsageError(status.message());
  return Failed(json, path, status);
}

CLI::Option* AddCheckpointPath(CLI::App& app, std::string& path, const std::string& name) {
  return app
      .add_option(
          name, path,
          "A .safetensors file, a checkpoint directory or a model.safetensors.index.json, "
          "local or as an s3://, gs:// or http(s):// URL; or hf://OWNER/NAME[@REVISION][/PATH], "
          "a repository in the local Hugging Face hub cache, else on the hub (HF_ENDPOINT; what "
          "is read is kept in the hub cache unless TENSORFERRY_OBJECT_HUB_CACHE=0)")
      ->required();
}

Result<OpenOptions> OpenOptionsFor(const std::string& path) {
  OpenOptions open;
  // The environment's settings (TENSORFERRY_OBJECT_*, S3 and HTTP ones) apply to URLs only: a
  // local checkpoint opens whatever the loading variables say.
  if (path.find("://") == std::string::npos) return open;
  Result<LoadOptions> env = LoadOptions::FromEnvironment();
  if (!env.ok()) return env.status();
  open.object_store = env->object_store;
  return open;
}

Result<std::shared_ptr<const Checkpoint>> OpenCheckpoint(const std::string& path) {
  Result<OpenOptions> open = OpenOptionsFor(path);
  if (!open.ok()) return open.status();
  return Checkpoint::Open(path, *open);
}

Progress::Progress(size_t total) : total_(total), tty_(::isatty(STDERR_FILENO) == 1) {}

Progress::~Progress() {
  if (tty_) std::fprintf(stderr, "\r%80s\r", "");
}

void Progress::Step(const std::string& what) {
  ++done_;
  Draw(done_, total_, std::to_string(done_) + "/" + std::to_string(total_) + " " + what);
}

void Progress::Bytes(uint64_t done, uint64_t total, double seconds) {
  char rate[32];
  std::snprintf(rate, sizeof rate, "%.2f GB/s",
                seconds > 0 ? static_cast<double>(done) / seconds / 1e9 : 0.0);
  Draw(done, total, FormatBytes(done) + " of " + FormatBytes(total) + ", " + rate);
}

void Progress::Draw(uint64_t done, uint64_t total, const std::string& what) {
  if (!tty_) return;
  const uint64_t width = 30;
  const uint64_t filled = total ? std::min(width, done * width / total) : width;
  std::fprintf(stderr, "\r[%s%s] %-44.44s", std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), what.c_str());
  std::fflush(stderr);
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

unsigned HashThreads() {
  return std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
}

double SecondsSince(int64_t start_ns) {
  return static_cast<double>(NowNs() - start_ns) * 1e-9;
}

// --- CRC32C (Castagnoli), hardware when the CPU has SSE4.2
// ----------------------------------------

namespace {

uint32_t Crc32cSoftware(uint32_t crc, const unsigned char* p, size_t n) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t crc, const unsigned char* p,
                                                          size_t n) {
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return ~c32;
}
#endif

}  // namespace

uint32_t Crc32c(const std::byte* data, size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  if (hw) return Crc32cHardware(0, p, n);
#endif
  return Crc32cSoftware(0, p, n);
}

// FNV-1a over (name, crc) in name order, as 16 hex digits.
uint64_t CombineTensorSums(TensorSums sums) {
  std::sort(sums.begin(), sums.end());
  uint64_t combined = 0xcbf29ce484222325ull;
  for (const auto& [name, crc] : sums) {
    for (unsigned char c : name) combined = (combined ^ c) * 0x100000001b3ull;
    for (int i = 0; i < 4; ++i)
      combined = (combined ^ ((crc >> (8 * i)) & 0xff)) * 0x100000001b3ull;
  }
  return combined;
}

std::string ChecksumHex(uint64_t checksum) {
  char hex[32];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum));
  return hex;
}

std::string CombinedChecksum(TensorSums sums) {
  return ChecksumHex(CombineTensorSums(std::move(sums)));
}

Status AppendTensorSums(std::span<const Tensor> tensors, TensorSums& sums,
                        std::vector<std::byte>& staging) {
  for (const Tensor& t : tensors) {
    if (t.device().is_cuda()) {
      if (staging.size() < t.size()) staging.resize(t.size());
      const std::span<std::byte> host(staging.data(), t.size());
      const Status copied = CopyToHost(t.device(), t.data(), host);
      if (!copied.ok()) return copied;
      sums.emplace_back(t.name(), Crc32c(host.data(), host.size()));
    } else {
      sums.emplace_back(t.name(), Crc32c(t.data(), t.size()));
    }
  }
  return Status::Ok();
}

}  // namespace tensorferry::cli
