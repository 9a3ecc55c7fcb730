// Internal: what the credential resolvers of the bucket stores share (aws_config, aws_credentials,
// gcs_auth): the environment as a function, the small JSON documents credential endpoints answer,
// form bodies, the request loop for a credentials endpoint, and secrets that are fetched again
// before they expire.
//
// Contract:
//   * Nothing here reads the process environment except ProcessEnv's function.
//   * Refreshing<T> is thread-safe: one fetch at a time; other callers wait for it.
//   * Errors are values naming the source (file, URL) given; secrets are never quoted.
#pragma once

#include <simdjson.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "objstore/http.h"
#include "tensorferry/status.h"

namespace tensorferry::objstore {

using GetEnv = std::function<std::optional<std::string>(const char* name)>;  // empty value = unset
GetEnv ProcessEnv();                                                         // std::getenv

// env(name), with an empty value read as unset (and no function as nothing set).
std::optional<std::string> Env(const GetEnv& env, const char* name);
// Whether env(name) is "true" (any case) or "1".
bool EnvTrue(const GetEnv& env, const char* name);

// Parses `text` with `parser`, allocated for exactly this document first, nesting at most 64
// levels (credentials and token answers are flat objects).
simdjson::error_code ParseJson(simdjson::dom::parser& parser, std::string_view text,
                               simdjson::dom::element& root);

// The string members of a flat JSON object (other members are skipped). Errors:
// kInvalidArgument "<source>: not valid JSON (...)" / "...: the JSON is <type>, not an object".
Result<std::map<std::string, std::string>> StringMembers(std::string_view text,
                                                         const std::string& source);

// "a=v1&b=v2" with the values percent-encoded (application/x-www-form-urlencoded).
std::string FormEncode(std::initializer_list<std::pair<const char*, std::string_view>> fields);

// The first `limit` bytes of `text` with control and non-ASCII bytes as spaces (error bodies in
// messages).
std::string PrintableExcerpt(std::string_view text, size_t limit = 160);

// `request` sent by `client`, again (after 200 and 400 ms) while the answer is no answer, 429 or
// a 5xx: three attempts in all. Credentials endpoints answer small documents quickly.
HttpResponse AskCredentialsEndpoint(const HttpClient& client, const HttpRequest& request);

// An unsigned client for a credentials endpoint: the transport's TLS settings, its timeout capped
// at max_timeout_ms. Errors: those of HttpClient::Make.
Result<std::unique_ptr<HttpClient>> CredentialsClient(const HttpSettings& transport,
                                                      uint32_t max_timeout_ms = UINT32_MAX);

// The one T per credentials (`fields`, `kind`) and transport in the process: make() runs, under
// a lock, for settings not seen before; later calls with the same settings get the same object,
// so every source opened with them shares what it fetched. Kept for the life of the process (a
// handful of entries at most).
template <typename T, typename Make>
Result<std::shared_ptr<T>> SharedPerProcess(std::initializer_list<const std::string*> fields,
                                            int kind, const HttpSettings& transport, Make&& make) {
  static std::mutex* mu = new std::mutex;
  static auto* shared = new std::map<std::string, std::shared_ptr<T>>;
  std::string key = std::to_string(kind) + "/" + std::to_string(transport.timeout_ms) + "/" +
                    (transport.verify_tls ? "1" : "0") + "/" +
                    std::to_string(transport.ca_bundle.size()) + ":" + transport.ca_bundle;
  for (const std::string* field : fields) key += std::to_string(field->size()) + ":" + *field;
  std::lock_guard<std::mutex> lock(*mu);
  if (auto it = shared->find(key); it != shared->end()) return it->second;
  Result<std::shared_ptr<T>> made = make();
  if (made.ok()) shared->emplace(std::move(key), *made);
  return made;
}

// A secret fetched when first needed and again before it expires: 5 minutes before its end (at
// half-life for one that lives under 10 minutes). A fetch that fails while the one it would
// replace is still good (until 30 s, or a quarter of a shorter life, before its end) keeps the
// old one and is tried again in 10 s; without a good one its error is returned.
template <typename T>
class Refreshing {
 public:
  // A fetched value and how long it lives; nullopt: for ever (never fetched again).
  struct Fetched {
    T value;
    std::optional<std::chrono::seconds> life;
  };

  // The value, fetched by fetch() (a Result<Fetched>) when there is none or its time has come.
  template <typename Fetch>
  Result<T> Get(Fetch&& fetch) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (have_ && now < refresh_at_) return value_;
    Result<Fetched> fetched = fetch();
    if (!fetched.ok()) {
      if (have_ && now < expires_at_) {
        refresh_at_ = std::min(expires_at_, now + std::chrono::seconds(10));
        return value_;
      }
      return fetched.status();
    }
    ++fetches_;
    value_ = std::move(fetched->value);
    have_ = true;
    if (!fetched->life) {
      refresh_at_ = expires_at_ = std::chrono::steady_clock::time_point::max();
      return value_;
    }
    // At least a second (keys handed out already expired are used once), at most 30 days.
    const std::chrono::seconds life =
        std::clamp(*fetched->life, std::chrono::seconds(1), std::chrono::seconds(30 * 86400));
    refresh_at_ = now + std::max(life - std::chrono::seconds(300), life / 2);
    expires_at_ = now + life - std::min<std::chrono::seconds>(std::chrono::seconds(30), life / 4);
    return value_;
  }

  // Forgets the value when `refused(value)` (the server refused it), so that the next Get
  // fetches another.
  template <typename Pred>
  void ForgetIf(Pred&& refused) {
    std::lock_guard<std::mutex> lock(mu_);
    if (have_ && refused(value_)) have_ = false;
  }

  uint64_t fetches() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fetches_;
  }

 private:
  mutable std::mutex mu_;
  bool have_ = false;
  T value_{};
  std::chrono::steady_clock::time_point refresh_at_{};
  std::chrono::steady_clock::time_point expires_at_{};
  uint64_t fetches_ = 0;
};

}  // namespace tensorferry::objstore
