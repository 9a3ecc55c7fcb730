#include "objstore/checkpoint_objects.h"

#include <utility>

#include "tensorferry/checkpoint.h"

namespace tensorferry::objstore {

Result<CheckpointObjects> FindCheckpointObjects(Source& source, const ObjectUrl& url,
                                                std::vector<ObjectRequest>* asked) {
  const auto ask = [&](const std::string& what, bool list) {
    if (asked != nullptr) asked->push_back(ObjectRequest{what, list});
  };
  CheckpointObjects out;
  if (KeyEndsWith(url, ".json")) {
    out.index = url.ToString();
    return out;
  }
  if (KeyEndsWith(url, ".safetensors")) {
    out.files.push_back(url.ToString());
    return out;
  }
  const std::string index = Join(url, kIndexFileName).ToString();
  ask(index, false);
  Result<std::unique_ptr<SourceFile>> probe = source.Open(index);
  if (probe.ok()) {
    out.index = index;
    out.opened = std::move(probe).value();
    return out;
  }
  const Code missing = probe.status().code();
  if (missing == Code::kCancelled) return probe.status();
  if (!IsBucketScheme(url.scheme)) {
    // An HTTP server cannot be listed: without an index, the prefix is a model folder's single
    // file (a Hugging Face model's model.safetensors), if it has one. Asked also when the index
    // was refused rather than missing: a bucket served over HTTP (S3's website or REST endpoint,
    // CloudFront) answers 403 AccessDenied for a key it does not have when listing is not
    // granted. Not when the index could not be read for another reason (a 503 after the
    // retries, a timeout): the prefix may hold both, and the index's error is the answer.
    if (missing != Code::kNotFound && missing != Code::kAccessDenied) return probe.status();
    const std::string single = Join(url, kSingleFileName).ToString();
    ask(single, false);
    Result<std::unique_ptr<SourceFile>> file = source.Open(single);
    if (file.ok()) {
      out.files.push_back(single);
      out.opened = std::move(file).value();
      return out;
    }
    if (missing != Code::kNotFound) {  // both answers: the index's first
      return Status(missing, probe.status().message() + "; and " + file.status().message());
    }
    if (file.status().code() != Code::kNotFound) return file.status();
    // What the server said of the file goes with it: a hub's 401 RepositoryNotFound (a private
    // model asked for without a token) or 404 RevisionNotFound says more than "neither".
    return Status(Code::kNotFound, url.ToString() + ": neither " + std::string(kIndexFileName) +
                                       " nor " + std::string(kSingleFileName) +
                                       " under this prefix (an HTTP server cannot be listed: give "
                                       "the URL of the index or of a .safetensors file); for " +
                                       std::string(kSingleFileName) + ": " +
                                       file.status().message());
  }
  if (missing != Code::kNotFound) return probe.status();
  ask(url.ToString(), true);
  Result<std::vector<std::string>> listed = source.List(url.ToString(), ".safetensors");
  if (!listed.ok()) {
    return Status(listed.status().code(), url.ToString() + ": no " + std::string(kIndexFileName) +
                                              " under this prefix, and " +
                                              listed.status().message());
  }
  if (listed->empty()) {
    return Status(Code::kNotFound, url.ToString() + ": no " + std::string(kIndexFileName) +
                                       " and no *.safetensors object directly under this prefix");
  }
  out.files = std::move(listed).value();
  out.listed = true;
  return out;
}

}  // namespace tensorferry::objstore
