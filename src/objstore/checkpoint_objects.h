// Internal: which objects a load of an object URL reads first, by the rules of object_store.h
// (a ".json" key is an index, a ".safetensors" key a file, anything else a prefix holding an
// index, else (S3, GCS) the *.safetensors objects listed directly under it, else (HTTP) its
// model.safetensors). Checkpoint::Open and DescribeObjectStore (`tensorferry doctor URL`) both
// resolve a URL here, so doctor asks what a load asks.
//
// Contract: one call makes at most two requests through `source` (a prefix's index, then its
// single file or its listing); safe from any thread that may use `source`.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "objstore/url.h"
#include "tensorferry/source.h"
#include "tensorferry/status.h"

namespace tensorferry::objstore {

// A request made on the way: an object opened (its first bytes), or a prefix listed.
struct ObjectRequest {
  std::string url;    // the object, or for a listing the prefix (tensorferry's URL form)
  bool list = false;  // a listing of the *.safetensors objects directly under `url`
};

struct CheckpointObjects {
  // The index describing the checkpoint: a ".json" URL, or a prefix's index that exists; "" when
  // there is none.
  std::string index;
  // Without an index, its files: a ".safetensors" URL; an HTTP prefix's model.safetensors; the
  // *.safetensors objects listed directly under an S3/GCS prefix (sorted, as Source::List gives
  // them; not checked as a shard series: the caller does that).
  std::vector<std::string> files;
  bool listed = false;  // `files` came from a listing
  // The object opened to find the above (a prefix's index or single file), which a load reads
  // next; null for a ".json" or ".safetensors" URL, which is not opened here, and a listing.
  std::unique_ptr<SourceFile> opened;
};

// Resolves `url` through `source`. `asked`, when given, receives each request made, in order
// (also when the call fails: the last one is the one that failed).
// Errors: `source`'s Open errors other than kNotFound for the prefix's index and single file (an
// HTTP prefix asks for its single file also when the index was refused, 403 as some buckets
// answer for a missing key, and when both fail names both: "<index error>; and <single error>");
// kNotFound "<url>: neither <index> nor <single> under this prefix (...)" for an HTTP prefix
// with neither; for an S3/GCS prefix without an index, the listing's error prefixed with
// "<url>: no <index> under this prefix, and ", or kNotFound when nothing is listed.
Result<CheckpointObjects> FindCheckpointObjects(Source& source, const ObjectUrl& url,
                                                std::vector<ObjectRequest>* asked = nullptr);

}  // namespace tensorferry::objstore
