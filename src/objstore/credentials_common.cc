// What the credential resolvers share (credentials_common.h).
#include "objstore/credentials_common.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "objstore/s3_xml.h"
#include "objstore/url.h"
#include "util/json_dom.h"

namespace tensorferry::objstore {

GetEnv ProcessEnv() {
  return [](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read-only use
    if (value == nullptr || *value == '\0') return std::nullopt;
    return std::string(value);
  };
}

std::optional<std::string> Env(const GetEnv& env, const char* name) {
  if (!env) return std::nullopt;
  std::optional<std::string> value = env(name);
  if (value && value->empty()) return std::nullopt;
  return value;
}

bool EnvTrue(const GetEnv& env, const char* name) {
  const auto value = Env(env, name);
  if (!value) return false;
  std::string lower = *value;
  for (char& c : lower) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return lower == "true" || lower == "1";
}

simdjson::error_code ParseJson(simdjson::dom::parser& parser, std::string_view text,
                               simdjson::dom::element& root) {
  if (auto err = parser.allocate(std::max<size_t>(text.size(), 64), 64); err != simdjson::SUCCESS) {
    return err;
  }
  const simdjson::padded_string padded(text.data(), text.size());
  return parser.parse(padded).get(root);
}

Result<std::map<std::string, std::string>> StringMembers(std::string_view text,
                                                         const std::string& source) {
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (auto err = ParseJson(parser, text, root); err != simdjson::SUCCESS) {
    return Status(Code::kInvalidArgument,
                  source + ": not valid JSON (" + simdjson::error_message(err) + ")");
  }
  simdjson::dom::object object;
  if (root.get(object) != simdjson::SUCCESS) {
    return Status(Code::kInvalidArgument,
                  source + ": the JSON is " + json::TypeName(root.type()) + ", not an object");
  }
  std::map<std::string, std::string> out;
  for (auto field : object) {
    std::string_view value;
    if (field.value.get(value) == simdjson::SUCCESS) out[std::string(field.key)] = value;
  }
  return out;
}

std::string FormEncode(std::initializer_list<std::pair<const char*, std::string_view>> fields) {
  std::string out;
  for (const auto& [name, value] : fields) {
    if (!out.empty()) out += '&';
    out += name;
    out += '=';
    out += PercentEncode(value, false);
  }
  return out;
}

HttpSettings CredentialsSettings(const HttpSettings& transport, uint32_t max_timeout_ms) {
  HttpSettings hs;  // unsigned
  hs.timeout_ms = std::min(transport.timeout_ms, max_timeout_ms);
  hs.verify_tls = transport.verify_tls;
  hs.ca_bundle = transport.ca_bundle;
  return hs;
}

Result<std::unique_ptr<HttpClient>> CredentialsClient(const HttpSettings& transport,
                                                      uint32_t max_timeout_ms) {
  return HttpClient::Make(CredentialsSettings(transport, max_timeout_ms));
}

HttpResponse AskCredentialsEndpoint(const HttpClient& client, const HttpRequest& request,
                                    int attempts) {
  HttpResponse r;
  for (int attempt = 1;; ++attempt) {
    r = client.Get(request);
    bool transient = r.status == 0 || r.status == 429 || r.status >= 500;
    if (r.status == 400) {
      const std::optional<S3ErrorBody> e = ParseS3Error(r.text);
      transient = e && (e->code == "Throttling" || e->code == "IDPCommunicationError");
    }
    if (!transient || attempt >= attempts || r.cancelled) return r;
    // A cancel is seen within 20 ms of the wait.
    for (int ms = 100 << std::min(attempt, 5); ms > 0; ms -= 20) {
      if (io::CancelScope::Requested()) {
        r.cancelled = true;
        return r;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(ms, 20)));
    }
  }
}

}  // namespace tensorferry::objstore
