// Internal: what the credential resolvers of the bucket stores share (aws_config, aws_credentials,
// gcs_auth): the environment as a function, the small JSON documents credential endpoints answer,
// form bodies, the request loop for a credentials endpoint, and secrets that are fetched again
// before they expire.
//
// Contract:
//   * Nothing here reads the process environment except ProcessEnv's function.
//   * Refreshing<T> is thread-safe: one fetch at a time, outside its lock.
//   * Errors are values naming the source (file, URL) given; secrets are never quoted.
#pragma once

#include <simdjson.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "io/read_engine.h"
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

// `request` sent by `client`, again (after 200, 400, ... ms) while the answer is no answer, 429,
// a 5xx, or an AWS error document whose code is Throttling or IDPCommunicationError (STS):
// `attempts` in all. Credentials endpoints answer small documents quickly.
HttpResponse AskCredentialsEndpoint(const HttpClient& client, const HttpRequest& request,
                                    int attempts = 3);

// The settings of a client for a credentials endpoint: unsigned, the transport's TLS settings,
// its timeout capped at max_timeout_ms.
HttpSettings CredentialsSettings(const HttpSettings& transport,
                                 uint32_t max_timeout_ms = UINT32_MAX);
// A client with those settings. Errors: those of HttpClient::Make.
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
// half-life for one that lives under 10 minutes). One caller fetches at a time, without holding
// the lock: while it does, the others go on with the value it replaces as long as that is still
// good (until 30 s, or a quarter of a shorter life, before its end), and wait for the fetch only
// without one. A fetch that fails while the old value is still good keeps it and is tried again
// in 10 s; without a good one its error is returned (to that caller and to those that waited).
// Clock: steady_clock, or a test's (a type with steady_clock's members, its now() static).
template <typename T, typename Clock = std::chrono::steady_clock>
class Refreshing {
 public:
  // A fetched value and how long it lives; nullopt: for ever (never fetched again).
  struct Fetched {
    T value;
    std::optional<std::chrono::seconds> life;
  };

  // The value, fetched by fetch() (a Result<Fetched>) when there is none or its time has come.
  // A caller waiting for another's fetch stops waiting when its own load is cancelled
  // (io::CancelScope: kCancelled).
  template <typename Fetch>
  Result<T> Get(Fetch&& fetch) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      const auto now = Clock::now();
      if (have_ && now < refresh_at_) return value_;
      if (!fetching_) break;
      if (have_ && now < expires_at_) return value_;  // another caller is fetching its successor
      const uint64_t ended = ended_;
      ++waiting_;
      while (fetching_ && ended_ == ended) {
        done_.wait_for(lock, std::chrono::milliseconds(50));
        if (io::CancelScope::Requested()) {
          --waiting_;
          return Status(Code::kCancelled, "the load was cancelled while credentials were fetched");
        }
      }
      --waiting_;
      // That fetch failed and left nothing good: its error, unless it failed because its own
      // caller's load was cancelled (then this caller fetches for itself).
      if (ended_ != ended && !have_ && last_error_.code() != Code::kCancelled) return last_error_;
    }
    fetching_ = true;
    lock.unlock();
    Result<Fetched> fetched = Status(Code::kInternal, "credentials fetch threw an exception");
    {
      struct Ended {  // whatever fetch() does (an exception too), the waiters are woken
        Refreshing& r;
        std::unique_lock<std::mutex>& lock;
        ~Ended() {
          if (!lock.owns_lock()) lock.lock();
          r.fetching_ = false;
          ++r.ended_;
          r.done_.notify_all();
        }
      } ended{*this, lock};
      try {
        fetched = fetch();
      } catch (...) {
        lock.lock();
        have_ = false;
        last_error_ = Status(Code::kInternal, "credentials fetch threw an exception");
        throw;
      }
      lock.lock();
    }
    const auto now = Clock::now();
    if (!fetched.ok()) {
      if (have_ && now < expires_at_) {
        refresh_at_ = std::min(expires_at_, now + std::chrono::seconds(10));
        return value_;
      }
      have_ = false;
      last_error_ = fetched.status();
      return fetched.status();
    }
    ++fetches_;
    value_ = std::move(fetched->value);
    have_ = true;
    if (!fetched->life) {
      refresh_at_ = expires_at_ = Clock::time_point::max();
      return value_;
    }
    // At least a second, at most 30 days.
    const std::chrono::seconds life =
        std::clamp(*fetched->life, std::chrono::seconds(1), std::chrono::seconds(30 * 86400));
    refresh_at_ = now + std::max(life - std::chrono::seconds(300), life / 2);
    expires_at_ = now + life - std::min<std::chrono::seconds>(std::chrono::seconds(30), life / 4);
    return value_;
  }

  // Forgets the value when `refused(value)` (the server refused it), so that the next Get
  // fetches another. Returns whether it was forgotten.
  template <typename Pred>
  bool ForgetIf(Pred&& refused) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!have_ || !refused(value_)) return false;
    have_ = false;
    return true;
  }

  uint64_t fetches() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fetches_;
  }

  // Callers waiting now for another's fetch to end (for tests).
  unsigned waiting() const {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable done_;  // a fetch ended
  bool fetching_ = false;
  uint64_t ended_ = 0;  // fetches that ended (failed ones too)
  bool have_ = false;
  T value_{};
  Status last_error_;
  typename Clock::time_point refresh_at_{};
  typename Clock::time_point expires_at_{};
  uint64_t fetches_ = 0;  // fetches that succeeded
  unsigned waiting_ = 0;  // callers in the wait for another's fetch
};

}  // namespace tensorferry::objstore
