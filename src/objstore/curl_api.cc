// libcurl loaded at run time (curl_api.h).
#include "objstore/curl_api.h"

#include <cstdlib>
#include <mutex>
#include <vector>

#include "util/dynamic_library.h"
#include "util/macros.h"

namespace tensorferry::objstore {

namespace {

Result<CurlApi> LoadCurl() {
  std::vector<std::string> candidates;
  const char* forced = std::getenv("TENSORFERRY_CURL_LIBRARY");
  const bool exclusive = forced != nullptr && *forced != '\0';
  if (exclusive) {
    candidates.push_back(forced);
  } else {
    candidates = {"libcurl.so.4", "libcurl-gnutls.so.4", "libcurl-nss.so.4"};
  }
  Result<dynlib::LoadedLibrary> lib =
      dynlib::FindOrOpen(candidates, candidates, exclusive, "libcurl", Code::kUnsupported);
  if (!lib.ok()) {
    return Status(Code::kUnsupported,
                  lib.status().message() +
                      " (object storage needs libcurl: install libcurl4, or set "
                      "TENSORFERRY_CURL_LIBRARY to its path)");
  }
  CurlApi api;
  api.path = lib->path;
  const Code missing = Code::kUnsupported;
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_global_init", api.global_init, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_easy_init", api.easy_init, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_easy_cleanup", api.easy_cleanup, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_easy_reset", api.easy_reset, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_easy_setopt", api.easy_setopt, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_easy_perform", api.easy_perform, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_easy_getinfo", api.easy_getinfo, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_easy_strerror", api.easy_strerror, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_slist_append", api.slist_append, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_slist_free_all", api.slist_free_all, missing));
  TF_RETURN_IF_ERROR(dynlib::Resolve(*lib, "curl_version_info", api.version_info, missing));
  const curl_version_info_data* info = api.version_info(CURLVERSION_NOW);
  if (info != nullptr && info->version != nullptr) api.version = info->version;
  // 7.75.0 signs, but only 7.87.0 signs the x-amz-content-sha256 header S3 requires
  // (UNSIGNED-PAYLOAD, sent with every request): older versions sign the hash of an empty body,
  // and S3 answers SignatureDoesNotMatch to every signed read (curl PRs 9804 and 9995).
  api.has_sigv4 = info != nullptr && info->version_num >= 0x075700;  // 7.87.0
  const CURLcode init = api.global_init(CURL_GLOBAL_ALL);
  if (init != CURLE_OK) {
    return Status(Code::kUnsupported,
                  api.path + ": curl_global_init failed: " + std::string(api.easy_strerror(init)));
  }
  return api;
}

}  // namespace

Result<const CurlApi*> Curl() {
  static const Result<CurlApi>* loaded = new Result<CurlApi>(LoadCurl());  // never destroyed
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

}  // namespace tensorferry::objstore
