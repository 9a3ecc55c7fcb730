// Internal: the access token sent to plain HTTP(S) origins (a model hub's, for gated or private
// models).
//
// Resolution, first found wins:
//   1. the http_token option (ObjectStoreOptions::http_token): sent to every http(s) origin of
//      the load;
//   2. Hugging Face's, as huggingface_hub finds it: HF_TOKEN, else the file HF_TOKEN_PATH, else
//      $HF_HOME/token (HF_HOME defaults to $XDG_CACHE_HOME/huggingface, else
//      ~/.cache/huggingface); sent only to the hub's origins: https://huggingface.co,
//      https://hf.co and the origin of HF_ENDPOINT (a mirror) when it is set. Other servers never
//      see it.
// The token goes as "Authorization: Bearer <token>" to the origin only (its scheme, host and
// port): never to another host it redirects to (a CDN's signed link carries its own
// authorization; libcurl drops the header on a redirect to another host, and a remembered
// redirect target elsewhere is asked without it).
//
// Contract: ResolveHttpToken reads the environment only through the GetEnv given (tests inject
// one) and files only through ReadSmallFile; thread-safe when that GetEnv is. Errors: a token
// file that exists but cannot be read (kIoError, kInvalidArgument naming the file); a missing
// file is no token. A token with characters outside printable ASCII (it would end the header) is
// kInvalidArgument naming where it came from, never quoting it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "objstore/aws_config.h"
#include "tensorferry/status.h"

namespace tensorferry::objstore {

struct HttpToken {
  std::string token;          // "" = none
  std::string from;           // "the http_token option", "HF_TOKEN", or the token file's path
  bool every_origin = false;  // the option's token
  std::vector<std::string> origins;  // otherwise, these only ("https://huggingface.co")

  // The token to send to `origin` ("scheme://host[:port]", compared case-insensitively), or "".
  std::string For(std::string_view origin) const;
};

Result<HttpToken> ResolveHttpToken(const std::string& option, const GetEnv& env = ProcessEnv());

}  // namespace tensorferry::objstore
