// tensorferry/object_store.h: checkpoints in object storage (S3-compatible, Google Cloud Storage)
// and on HTTP servers.
//
// A path that starts with "s3://", "gs://", "http://" or "https://" is a URL: Checkpoint::Open,
// Loader::Open, every CLI command that reads and the Python API read it through an object Source
// (source.h) instead of the file system. What a URL names is decided by its key, as for local
// paths:
//   ".../model.safetensors.index.json" (any ".json"): a sharded checkpoint; its files are the keys
//       "<index's prefix>/<weight_map value>"; a value that would leave that prefix (absolute,
//       "..") is kIndexPathEscape, as for local files;
//   ".../x.safetensors": one file;
//   anything else is a prefix ("directory"): "<prefix>/model.safetensors.index.json" when that
//       object exists, else (S3 and GCS only) every "<prefix>/*.safetensors" object directly under
//       it, listed with ListObjectsV2. An HTTP server cannot be listed: there the prefix's
//       "model.safetensors" is the checkpoint when it has no index, else kNotFound naming both.
//
// HTTP(S) servers and model hubs (https://huggingface.co/<org>/<model>/resolve/main/ is a prefix):
// redirects are followed (to http:// or https://; from https:// to https:// only) and remembered
// per URL, so a file's later GETs go straight to the signed link its first GET was sent to; a
// link that stops answering (401, 403, 404, 410: expired) is replaced by asking the URL again,
// at once. An access token (http_token, else HF_TOKEN for the Hugging Face hub's origins) goes to
// the origin only, never to where it redirects.
//
// Transport: libcurl, loaded at run time (libcurl.so.4; TENSORFERRY_CURL_LIBRARY names another
// file): connection reuse, HTTP/1.1 and HTTP/2 over TLS, AWS Signature V4. Every read is a ranged
// GET written straight into the caller's buffer; `concurrency` GETs are in flight per load (the
// loader's read workers), each of at most `part_size` bytes. Opening a file costs one ranged GET
// of its first `header_bytes` bytes, which gives its size, its ETag and (for headers up to that
// size) its whole safetensors header: one round trip per file; Checkpoint::Open opens a
// checkpoint's objects 16 at a time.
//
// Consistency: every GET carries If-Match with the ETag seen when the file was opened (and the
// response's ETag and total size are compared with it), so an object overwritten during a load is
// reported as a local file replaced under a load is: kIoError "<url>: file changed since the
// checkpoint was opened: ...". A weak ETag (W/"...") is compared but not sent (If-Match is a
// strong comparison); without an ETag (some HTTP servers), its Last-Modified is (If-Unmodified-
// Since, and each response's compared: one second's resolution), and without either the size
// alone. The server must answer Range requests (206): one that ignores them is refused for any
// object larger than the first GET's `header_bytes`.
//
// Faults: connection errors (reset, refused, truncated body), stalls (no byte for `timeout_ms`,
// or fewer than 4 KiB a second over it), HTTP 429, 500, 502, 503, 504 and the S3 codes SlowDown,
// InternalError, RequestTimeout, ServiceUnavailable, Throttling (and a 401 to a GCS token that
// could be renewed: it is, first) are retried up to `retries` times with exponential backoff and
// equal jitter (half of each delay random, at most 10 s); a retry resumes the range from the last
// byte received. Other statuses, and TLS failures (a certificate that does not verify), end the
// read at once. Errors name the URL, the byte range,
// the HTTP status, the S3 error code and message from the body, the attempts made, and where the
// credentials and endpoint came from (kNotFound for 404/NoSuchKey/NoSuchBucket, kIoError
// otherwise). A load that fails hands out no batch it could not complete.
//
// Credentials and endpoints (S3) are resolved as the AWS CLI does: each field below when set, else
// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE with
// ~/.aws/credentials and ~/.aws/config (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE), AWS_REGION /
// AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_NO_SIGN_REQUEST. No credentials
// anywhere means unsigned (anonymous) requests. docs/object_storage.md lists every setting.
//
// Google Cloud Storage (gs://bucket/key) is read through its S3-compatible XML API (endpoint
// https://storage.googleapis.com, or `endpoint`; path-style), with credentials as Google's client
// libraries find them: HMAC keys (access_key_id + secret_access_key: Signature V4), an OAuth 2
// token (gcs_token, GOOGLE_OAUTH_ACCESS_TOKEN), GOOGLE_APPLICATION_CREDENTIALS or gcloud's
// application_default_credentials.json (authorized_user or service_account: tokens fetched and
// refreshed), the metadata server of a Google Cloud VM or GKE pod (GCE_METADATA_HOST), else
// anonymous. The AWS variables and files do not apply to gs:// URLs; profile, session_token and
// path_style are not used for them, and region (signed with HMAC keys) defaults to "auto".
//
// Local cache (cache_dir below): opening a file whose copy is in the cache reads the copy; a file
// whose copy is missing is downloaded whole into the cache beside the load that first reads it
// beyond its header (the load reads through the download as it arrives). The load never waits for
// the local disk: what a disk slower than the network cannot take in time is fetched again for
// the copy after the load (unless cache_fetch_once), and copies still in progress when the Source's
// last owner (a closed checkpoint or file) lets go are finished in the background:
// WaitForObjectCaches() waits for them, and so does the process's normal exit. A cache that fails
// (a full disk, a directory that cannot be written, a download the store breaks off) never fails a
// load: the file is read from the store and the failure shows in the source's stats and the load's
// engine_reason.
//
// Thread-safety: options are values; the Source is safe to use from several threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorferry/source.h"
#include "tensorferry/status.h"

namespace tensorferry {

struct ObjectStoreOptions {
  // --- S3 (each "" / -1 = resolved from the environment and AWS files, as above) ---
  std::string endpoint;  // "http(s)://host[:port]" (LoadOptions key s3_endpoint)
  std::string region;    // s3_region; default us-east-1
  std::string profile;   // s3_profile
  std::string access_key_id, secret_access_key, session_token;  // s3_access_key_id, ...
  int anonymous = -1;   // s3_anonymous: 1 = never sign (public buckets)
  int path_style = -1;  // s3_path_style: 1 path-style, 0 virtual-hosted, -1 auto (path-style
                        // for endpoints other than AWS's)
  // --- Google Cloud Storage (gs://): endpoint, access_key_id/secret_access_key (HMAC keys) and
  // anonymous above apply too ---
  std::string gcs_token;  // gcs_token: an OAuth 2 access token, sent as "Authorization: Bearer"
  // --- plain HTTP(S) origins (a model hub) ---
  // http_token: an access token sent as "Authorization: Bearer" to every http(s):// origin of the
  // load (never to where they redirect: a CDN's signed links). Else HF_TOKEN or huggingface_hub's
  // token file, sent to the Hugging Face hub's origins only (huggingface.co, hf.co, HF_ENDPOINT).
  std::string http_token;
  // --- transport (S3 and HTTP) ---
  // Ranged GETs in flight (object_concurrency) and bytes per GET (object_part_size); 0 = auto:
  // 8 GETs of 32 MiB while every object opened so far came from this host (the connection's
  // address is a loopback address or one of this host's interfaces: the server shares the
  // client's CPUs, and each further connection costs both sides CPU without adding bandwidth),
  // else 32 GETs of 8 MiB (a remote store limits each connection; many in flight fill the link).
  // Each one set alone keeps the other's automatic value.
  unsigned concurrency = 0;
  uint64_t part_size = 0;
  unsigned retries = 6;          // further attempts per request after the first (object_retries)
  uint32_t timeout_ms = 30'000;  // a request receiving no byte for this long is retried, and a
                                 // connection not made in this time fails (object_timeout_ms)
  uint64_t header_bytes =
      256u << 10;             // the speculative first GET of each file (object_header_bytes)
  uint32_t backoff_ms = 100;  // first retry delay, doubled per attempt, capped at 10 s, jittered
  bool verify_tls = true;     // object_verify_tls: verify the server's certificate
  std::string ca_bundle;      // object_ca_bundle: a CA file instead of the system's
  // --- local cache (S3 and HTTP) ---
  // object_cache_dir: keep a whole copy of each file read in this directory (created when
  // missing; several processes may share it) and read the copy; "" = no cache. An object is
  // downloaded once per version (URL, strong ETag, size): later opens, by this process or
  // another, cost one ranged GET (the open's, which checks the ETag) and read local disk. Objects
  // without a strong ETag, and those the open's first GET already holds whole, are not cached.
  // docs/object_storage.md ("Local cache") has the layout and the guarantees.
  std::string cache_dir;
  // object_cache_max: the most bytes the cache's entries may hold (least recently used entries
  // are removed to make room); 0 = unbounded.
  uint64_t cache_max = 0;
  // object_hub_cache: a file of the Hugging Face hub read at its resolve URL pinned to a commit
  // (<HF_ENDPOINT>/REPO/resolve/<commit>/PATH: how hf:// paths not in the local hub cache are
  // streamed, hub.h), or at a branch the hub names the commit of (X-Repo-Commit), is also kept
  // in the hub cache (HubCacheDir()) where huggingface_hub would put it: its blob, written beside
  // the load as cache_dir's copies are (below), then its snapshot link; so the next start, of
  // tensorferry or of any tool reading that cache (transformers, vLLM, `hf`), reads local disk.
  // Nothing is evicted there. Takes precedence over cache_dir for those files.
  bool hub_cache = true;
  // object_cache_write_behind: memory holding the bytes a load fetched for a copy in progress
  // until the cache's writer thread has written them to local disk (a ring, allocated at the
  // first such write; per cache). What it has no room for, when the disk is slower than the
  // network, is fetched again after the load (unless object_cache_fetch_once). 0: none.
  uint64_t cache_write_behind = 32ull << 20;
  // object_cache_fetch_once: when the writer is behind, the load waits for the local disk instead,
  // so each byte of a copy is fetched from the store once (stores billed by the byte served, or
  // rate-limited); off: a load never waits for the local disk (LoadStats::cache_refetch_bytes
  // counts what the copies fetch again).
  bool cache_fetch_once = false;
};

// --- the local cache, for tools (`tensorferry cache`) ---

// One file kept in a cache directory (ObjectStoreOptions::cache_dir).
struct ObjectCacheEntry {
  std::string key;        // its name under <dir>/blobs/ (64 hex digits)
  std::string url;        // the object it is a copy of ("s3://bucket/key", "https://host/path")
  std::string etag;       // the version (strong ETag) it is a copy of
  uint64_t size = 0;      // bytes
  int64_t last_used = 0;  // seconds since the epoch: when it was written or last opened
};

// The whole entries of the cache in `dir`, most recently used first (url and etag "" for an entry
// whose description <key>.json is missing or unreadable). Errors: kNotFound when `dir` holds no
// cache (no blobs/ directory), kIoError naming the directory.
Result<std::vector<ObjectCacheEntry>> ListObjectCache(const std::string& dir);

// Removes the least recently used entries of the cache in `dir` until the others hold at most
// `max_bytes` (0: removes every entry), skipping entries another process holds locked (filling
// or evicting them); also removes what downloads that ended without finishing left in tmp/. Safe
// while other processes load from the cache: an entry they opened stays readable to them. Returns
// the entries removed. Errors: those of ListObjectCache; kIoError when more than `max_bytes` is
// left because an entry could not be removed (its lock or file refused: no permission, no locks/
// folder), naming the file and the reason (entries removed before stay removed).
Result<std::vector<ObjectCacheEntry>> PruneObjectCache(const std::string& dir, uint64_t max_bytes);

// The downloads in the tmp/ folder of the cache in `dir`: those in progress (their file's key is
// locked by the process downloading it) and those left by downloads that ended without finishing
// (a process killed: PruneObjectCache removes them, as does the next download of the same file).
// Counts are downloads (a copy in progress, not the description written beside it as it commits);
// bytes are the local disk they take (allocated blocks: a download reserves its file's size when it
// starts).
struct ObjectCacheDownloads {
  uint64_t running = 0, running_bytes = 0;
  uint64_t left_over = 0, left_over_bytes = 0;
};
// Reads only (no lock file is made). Errors: kNotFound when `dir` holds no cache (no blobs/
// directory), kIoError naming tmp/ when it cannot be listed (a missing tmp/: no downloads).
Result<ObjectCacheDownloads> ObjectCacheDownloadsIn(const std::string& dir);

// True when `path` is an object-store or HTTP URL ("s3://", "http://", "https://").
bool IsObjectUrl(std::string_view path);

// `url` as it may be shown (reports, errors, logs): a "user:password@" replaced by "***@", and
// except for s3:// and gs:// URLs (whose keys may hold '?' and '#': part of the object's name)
// a query or fragment by "?***" or "#***" (a signed link's query is a credential). Text that is
// not "scheme://..." is returned as is. Every message of this library that names a URL a user
// gave or a server redirected to names it so.
std::string RedactUrl(std::string_view url);

// --- whole objects: the files beside a checkpoint (config.json, tokenizer files) ---

// The size in bytes of the object at `url`: one ranged GET, as opening a checkpoint file costs
// (its first ObjectStoreOptions::header_bytes). Errors: kInvalidArgument when `url` is not a URL
// (IsObjectUrl) or a setting is bad; kNotFound for a missing object or bucket; kCancelled once
// *cancel is true (as OpenOptions::cancel: the requests in flight, credential fetches included,
// are abandoned and the retries' waits cut short; nullptr: never; not owned, must outlive the
// call); otherwise those of a load's reads (kIoError naming the URL, HTTP status, S3 error code
// and attempts).
Result<uint64_t> ObjectSize(const std::string& url, const ObjectStoreOptions& options,
                            const std::atomic<bool>* cancel = nullptr);

// The whole object at `url`, read with the settings above (retries, ETag pinning: an object
// replaced between its first GET and the last is an error, never a mix of two versions). An
// object no larger than header_bytes costs one GET. Errors: those of ObjectSize, and
// kInvalidArgument naming the object's size when it is larger than `max_bytes` (nothing more is
// read). `cancel` as ObjectSize's.
Result<std::vector<std::byte>> ReadObject(const std::string& url, const ObjectStoreOptions& options,
                                          uint64_t max_bytes,
                                          const std::atomic<bool>* cancel = nullptr);

// The URLs of the objects directly under the s3:// or gs:// prefix `dir` whose names end with
// `suffix`, sorted (ListObjectsV2, every page). Errors: kNotFound for an http(s):// URL (a server
// cannot be listed) or a missing bucket; the others and `cancel` as ObjectSize's.
Result<std::vector<std::string>> ListObjects(const std::string& dir, std::string_view suffix,
                                             const ObjectStoreOptions& options,
                                             const std::atomic<bool>* cancel = nullptr);

// The same through `source` (a Source from MakeObjectSource) and its connections: a request to
// an origin the source talks to reuses a connection to it.
Result<std::vector<std::byte>> ReadObject(Source& source, const std::string& url,
                                          uint64_t max_bytes);

// --- diagnosis: what a URL resolves to and whether its store answers (tensorferry doctor URL) ---

struct ObjectStoreReport {
  std::string url;    // as given, redacted (RedactUrl)
  std::string store;  // "s3", "gs" or "http"; "" when `settings` refused the URL
  // Reading the URL (ParseObjectUrl's precise reason it is refused, naming it redacted; an hf://
  // path: kUnsupported, doctor does not probe hub paths) and resolving the settings (libcurl,
  // endpoint, region, the credentials' source): Ok or why not. Nothing below `settings` is filled
  // without it.
  Status settings;
  // Bucket stores: where each setting came from ("AWS_ENDPOINT_URL", "profile \"x\" in <file>",
  // "AWS default"...), as errors name them. Empty for http(s) URLs.
  std::string endpoint, endpoint_from, region, region_from;
  std::string addressing;        // "path-style" or "virtual-hosted" for this bucket
  std::string credentials_from;  // never a secret: where keys or tokens come from
  // Keys or tokens that are fetched (web identity, credential_process, container, instance
  // metadata, Google tokens): fetched once now, and what came back ("key ****WXYZ with a session
  // token", "no role: unsigned requests", "an OAuth token"); never a secret. Empty, with an Ok
  // status, when the keys are given or there are none.
  std::string credentials;
  Status credentials_status;
  double credentials_seconds = 0;
  // The requests a load makes first, as it makes them (the rules at the top of this header): an
  // index's or a file's first bytes (its size and version); for a prefix (a key not ending in
  // ".json" or ".safetensors"), "<prefix>/model.safetensors.index.json", and when that is not
  // found, the listing of the *.safetensors objects directly under the prefix (S3, GCS) or
  // "<prefix>/model.safetensors" (HTTP). In words, and timed.
  std::string request_url;  // the requests sent, in order, joined by " then "
  // The last request's answer, after what the earlier ones did not find: "object of 1234 bytes,
  // ETag \"...\"", "no s3://b/p/model.safetensors.index.json; 3 *.safetensors objects directly
  // under the prefix (ListObjectsV2)". "" when probe_status is an error (the load's error).
  std::string probe;
  Status probe_status;
  double probe_seconds = 0;
};

// Resolves `url`'s settings with `options` and asks its store what a load of `url` asks first
// (see ObjectStoreReport). Never fails: every problem is in the report's statuses, with the
// messages a load would give.
// Once *cancel is true, the credential fetch and the probe in progress are abandoned (as
// ObjectSize's) and the status of the step cut short is kCancelled. nullptr: never.
ObjectStoreReport DescribeObjectStore(const std::string& url, const ObjectStoreOptions& options,
                                      const std::atomic<bool>* cancel = nullptr);

// The Source reading URLs with these options. libcurl is loaded and the S3 settings resolved when
// the first URL is opened; their errors (kUnsupported: libcurl could not be loaded, naming what was
// tried; kInvalidArgument: a bad setting, naming it and where it came from) are that Open's.
// Errors here: kInvalidArgument for a part_size other than 0 below 4096.
Result<std::shared_ptr<Source>> MakeObjectSource(const ObjectStoreOptions& options);

// Blocks until the copies into caches (cache_dir, hub_cache) that were still in progress when
// their Source's last owner let go are whole in their caches (or given up: a cache never fails a
// load). A process that exits normally (exit(), returning from main) waits for them too; one
// killed or ended with _exit() leaves only temporary files, which the next download of the same
// object removes. Safe from any thread; returns at once when nothing is being copied.
void WaitForObjectCaches();
// The same for at most `timeout`: true when no such copy is left.
bool WaitForObjectCaches(std::chrono::milliseconds timeout);
// True while such copies are in progress.
bool ObjectCachesCopying();
// The copies finished in the background (above) that failed since the last call, oldest first,
// each in words naming the cache, the object and why ("object cache DIR: s3://bucket/key not
// cached: download failed: ..."); given-up copies (AbandonObjectCaches) among them. Such a
// failure cost no load anything: the next load of that file downloads it again. Call it after
// WaitForObjectCaches() for all of them (the CLI and Python's wait_for_caches() report them).
// At most the latest 256 are kept (then a first line says how many earlier ones were not).
// Safe from any thread.
std::vector<std::string> TakeObjectCacheFailures();
// Gives up every copy into a cache that this process has in progress or queued, those of open
// checkpoints included (each is removed, as a failed download is, and the next load of its file
// downloads it again; loads still running read the store for what a copy lacks), and returns at
// once: WaitForObjectCaches() then returns when their requests in flight have ended. For a
// process that must end now (tensorferry.wait_for_caches() on Ctrl-C). Copies begun later are
// not affected.
void AbandonObjectCaches();

}  // namespace tensorferry
