// Internal: object-store URLs (s3://bucket/key, gs://bucket/key, http(s)://host[:port]/path), the
// form every object-store path takes between the user and the transport.
//
// Contract:
//   * Pure functions over strings: no I/O, no globals, safe from any thread.
//   * ParseObjectUrl is strict: what it accepts can be put in a request line as is (no control
//     characters, no whitespace, no credentials, no query or fragment for http(s)); everything it
//     refuses is kInvalidArgument with a message naming the URL and the problem.
//   * An s3/gs key is kept raw (as S3 stores it; requests encode it with PercentEncode); an http(s)
//     key is the URL path as given, still percent-encoded.
#pragma once

#include <string>
#include <string_view>

#include "tensorferry/status.h"

namespace tensorferry::objstore {

// kGs: Google Cloud Storage, read through its S3-compatible XML API (gcs_auth.h).
enum class Scheme { kS3, kGs, kHttp, kHttps };

// True for the schemes whose URLs name a bucket and a key (s3, gs).
bool IsBucketScheme(Scheme scheme);

struct ObjectUrl {
  Scheme scheme = Scheme::kS3;
  std::string bucket;  // s3/gs only: the bucket
  std::string origin;  // http(s) only: "http://host[:port]" (scheme lower-cased, no trailing '/')
  std::string key;  // s3/gs: the object key or prefix (no leading '/'); http(s): the path without
                    // its leading '/' (still percent-encoded exactly as given)
  // "s3://bucket/key", "gs://bucket/key" or origin + "/" + key.
  std::string ToString() const;
  bool operator==(const ObjectUrl&) const = default;
};

// True when `path` starts with "s3://", "gs://", "http://" or "https://" (scheme
// case-insensitive).
bool IsObjectUrl(std::string_view path);

// Errors (kInvalidArgument, "object URL \"<url>\": <problem>"):
//   * not one of the schemes above;
//   * s3/gs: empty bucket, a bucket with characters outside [a-z0-9.-_] or longer than 255, a key
//     starting with '/' ("s3://b//k": S3 would store "/k", which no tool writes on purpose), a
//     key with a "." or ".." segment (opaque to the store, but resolved as a path step by
//     programs that join a prefix and a name, and by some servers: never another key than the
//     URL appears to name; the request sends keys as they are, HttpSettings::path_as_is);
//   * http(s): empty host, userinfo ("user@host": credentials never go in URLs), a '#fragment' or
//     '?query' (a query would change what a ranged GET means), a port that is not 1..65535, a host
//     with characters outside [A-Za-z0-9.-_~%] (or a bracketed IPv6 literal);
//   * any URL with a NUL or control character (including DEL); an http(s) URL with a space (a
//     bucket key may hold spaces: they are percent-encoded in the request).
// The message names RedactUrl(url), never a password or a signed link's query (when redaction
// hid the first problem, the problem named is the one the redacted part still shows: its
// userinfo, query or fragment).
Result<ObjectUrl> ParseObjectUrl(std::string_view url);

// `url` as it may be shown (errors, reports, logs): userinfo ("user:password@") replaced by
// "***@" for any "scheme://" URL, and for every scheme but s3 and gs (whose keys may hold '?' and
// '#': they are the object's name, sent percent-encoded) the query and fragment replaced by
// "?***" or "#***" (a signed link's query is a credential). Anything else, and text that is not
// "scheme://...", is returned as is. The one redaction of URLs: every place that shows one a
// user typed or a server sent uses it.
std::string RedactUrl(std::string_view url);

// A server's text (an error body, a header's value) as a message may quote it: the first `limit`
// bytes, control and non-ASCII bytes as spaces, and the query of any word holding a '?' hidden
// ("m.safetensors?X-Amz-Signature=..." as "m.safetensors?***": a body that echoes the signed link
// asked for must not print its signature).
std::string Excerpt(std::string_view text, size_t limit = 160);

// The URL of `relative` (an index's file entry, already checked for "..", absolute paths, etc. by
// ParseIndexJson) inside the "directory" `dir`: dir.key + "/" + relative, with exactly one '/'
// between them (dir.key may be empty or end with '/'); for s3/gs, "." segments of `relative` are
// dropped ("./x" is x, as for local files). For http(s), `relative` (a file name, not
// a URL) is percent-encoded with PercentEncode(relative, true) first, so that a name with a space
// or '#' still names that file; names of [A-Za-z0-9-_.~/] are unchanged.
ObjectUrl Join(const ObjectUrl& dir, std::string_view relative);

// The "directory" of `file`: its key up to (not including) the last '/'; "" when there is none.
ObjectUrl Parent(const ObjectUrl& file);

// True when `url.key` ends with `suffix` (case-sensitive; for ".json"/".safetensors" decisions).
bool KeyEndsWith(const ObjectUrl& url, std::string_view suffix);

// SigV4/RFC 3986 encoding: every byte except A-Z a-z 0-9 - _ . ~ as %XX (upper-case hex); with
// keep_slash '/' is kept (object keys in paths), without it encoded (query values).
std::string PercentEncode(std::string_view s, bool keep_slash);

}  // namespace tensorferry::objstore
