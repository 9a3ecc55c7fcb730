// libFuzzer target: the bytes are a Google credentials file (GOOGLE_APPLICATION_CREDENTIALS,
// gcloud's application_default_credentials.json), read by ParseGcsCredentials, and the body of a
// token endpoint's answer, read by ParseTokenAnswer. Neither may crash, hang or read outside the
// input. Credentials: errors are kInvalidArgument or kUnsupported naming the source and never
// quoting a secret (client_secret, refresh_token, private_key); what is accepted has every field
// its type needs and an http(s) token_uri. Token answers: an accepted token is non-empty
// printable ASCII without spaces (it goes into a header) and lives 1 s to a day.
#include <simdjson.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "objstore/gcs_auth.h"

namespace {

using tensorferry::Code;
using tensorferry::objstore::GcsConfig;
using tensorferry::objstore::GcsTokenKind;

// The secret strings of the input (top-level string members), as a JSON parser reads them,
// except those inside a value messages may show (type, token_uri).
std::vector<std::string> Secrets(std::string_view text) {
  std::vector<std::string> secrets, shown;
  simdjson::dom::parser parser;
  simdjson::dom::object object;
  if (parser.allocate(std::max<size_t>(text.size(), 64), 64) != simdjson::SUCCESS) return secrets;
  const simdjson::padded_string padded(text.data(), text.size());
  if (parser.parse(padded).get(object) != simdjson::SUCCESS) return secrets;
  for (auto field : object) {
    std::string_view value;
    if (field.value.get(value) != simdjson::SUCCESS) continue;
    if (field.key == "client_secret" || field.key == "refresh_token" ||
        field.key == "private_key") {
      // Long enough and with a digit (as real ones are: "1//0g...", "d-FL95Q19...", PEM): the
      // messages' own words cannot then match by chance.
      if (value.size() >= 16 && value.find_first_of("0123456789") != std::string_view::npos) {
        secrets.emplace_back(value);
      }
    } else if (field.key == "type" || field.key == "token_uri") {
      shown.emplace_back(value);
    }
  }
  std::vector<std::string> out;
  for (const std::string& secret : secrets) {
    bool inside = false;
    for (const std::string& v : shown) inside = inside || v.find(secret) != std::string::npos;
    if (!inside) out.push_back(secret);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string source = "fuzz.json";
  GcsConfig c;
  const tensorferry::Status s = tensorferry::objstore::ParseGcsCredentials(text, source, c);
  if (!s.ok()) {
    if (s.code() != Code::kInvalidArgument && s.code() != Code::kUnsupported) std::abort();
    if (s.message().rfind(source, 0) != 0) std::abort();
    for (const std::string& secret : Secrets(text)) {
      if (s.message().find(secret) != std::string::npos) std::abort();
    }
  } else {
    switch (c.token_kind) {
      case GcsTokenKind::kAuthorizedUser:
        if (c.client_id.empty() || c.client_secret.empty() || c.refresh_token.empty()) {
          std::abort();
        }
        break;
      case GcsTokenKind::kServiceAccount:
        if (c.client_email.empty() || c.private_key.empty()) std::abort();
        break;
      default: std::abort();
    }
    if (c.token_uri.rfind("http://", 0) != 0 && c.token_uri.rfind("https://", 0) != 0) {
      std::abort();
    }
  }

  auto answer = tensorferry::objstore::ParseTokenAnswer(text, "fuzz");
  if (!answer.ok()) {
    if (answer.status().code() != Code::kIoError) std::abort();
    if (answer.status().message().rfind("fuzz: ", 0) != 0) std::abort();
  } else {
    const std::string& token = answer->first;
    if (token.empty()) std::abort();
    for (char ch : token) {
      if (ch <= ' ' || ch >= 127) std::abort();
    }
    const auto life = answer->second.count();
    if (life < 1 || life > 86400) std::abort();
  }
  return 0;
}
