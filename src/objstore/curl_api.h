// Internal: libcurl, loaded at run time.
//
// tensorferry compiles against curl/curl.h (types, option and error constants) but never links
// libcurl: the library is opened with dlopen the first time an object-store URL is read, so the
// core library runs where libcurl is absent (a GPU node without it loses only object storage).
// Search: TENSORFERRY_CURL_LIBRARY when set (the only candidate), else a libcurl already in the
// process, then libcurl.so.4, libcurl-gnutls.so.4, libcurl-nss.so.4.
//
// curl_global_init runs once, when the library is first loaded.
// Thread-safety: Curl() may be called from any thread; the returned table is immutable. A CURL
// easy handle must be used by one thread at a time (libcurl's rule).
#pragma once

#include <curl/curl.h>

#include <string>

#include "tensorferry/status.h"

namespace tensorferry::objstore {

struct CurlApi {
  CURLcode (*global_init)(long flags) = nullptr;
  CURL* (*easy_init)() = nullptr;
  void (*easy_cleanup)(CURL*) = nullptr;
  void (*easy_reset)(CURL*) = nullptr;
  CURLcode (*easy_setopt)(CURL*, CURLoption, ...) = nullptr;
  CURLcode (*easy_perform)(CURL*) = nullptr;
  CURLcode (*easy_getinfo)(CURL*, CURLINFO, ...) = nullptr;
  const char* (*easy_strerror)(CURLcode) = nullptr;
  curl_slist* (*slist_append)(curl_slist*, const char*) = nullptr;
  void (*slist_free_all)(curl_slist*) = nullptr;
  curl_version_info_data* (*version_info)(CURLversion) = nullptr;
  std::string path;        // the library file loaded
  std::string version;     // "8.x.y"
  bool has_sigv4 = false;  // 7.87 and later: CURLOPT_AWS_SIGV4 signing x-amz-content-sha256
};

// The loaded library, or why it could not be loaded (kUnsupported: "libcurl not found; tried: ...
// (install libcurl4, or set TENSORFERRY_CURL_LIBRARY)"). Loaded once per process; never unloaded.
Result<const CurlApi*> Curl();

}  // namespace tensorferry::objstore
