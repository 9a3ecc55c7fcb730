// libFuzzer target: the bytes are what a credentials endpoint (ECS/EKS container credentials,
// the EC2 instance metadata service) or a credential_process wrote, read by
// ParseAwsCredentialsJson, and an Expiration time, read by ParseIso8601. Neither may crash, hang
// or read outside the input. Errors are kIoError naming the source and never quoting the secret
// key or the session token; accepted keys are non-empty, fit an HTTP header, and came out of the
// input. An accepted time is within the years 0000-9999 (give or take a day of offset).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "objstore/aws_credentials.h"

namespace {

bool HeaderSafe(const std::string& s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 32 || c == 127) return false;
  }
  return true;
}

void Check(std::string_view text, bool process) {
  using tensorferry::Code;
  const auto keys = tensorferry::objstore::ParseAwsCredentialsJson(text, "src", process);
  if (!keys.ok()) {
    if (keys.status().code() != Code::kIoError) std::abort();
    if (keys.status().message().rfind("src: ", 0) != 0) std::abort();
    return;
  }
  const auto& k = keys->keys;
  if (k.access_key_id.empty() || k.secret_access_key.empty()) std::abort();
  if (!HeaderSafe(k.access_key_id) || !HeaderSafe(k.secret_access_key) ||
      !HeaderSafe(k.session_token)) {
    std::abort();
  }
  // JSON unescaping never lengthens a string.
  if (k.access_key_id.size() + k.secret_access_key.size() + k.session_token.size() > text.size()) {
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Check(text, /*process=*/false);
  Check(text, /*process=*/true);
  if (const auto t = tensorferry::objstore::ParseIso8601(text)) {
    // 0000-01-01 minus a day of offset .. 9999-12-31 plus a day.
    const int64_t s = t->time_since_epoch().count();
    if (s < -62167219200 - 86400 || s > 253402300800 + 86400) std::abort();
  }
  return 0;
}
