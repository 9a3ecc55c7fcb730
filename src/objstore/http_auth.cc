// ResolveHttpToken (http_auth.h).
#include "objstore/http_auth.h"

#include <algorithm>
#include <cctype>

#include "objstore/url.h"
#include "util/macros.h"

namespace tensorferry::objstore {

namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string Trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

Status CheckPrintable(const std::string& token, const std::string& from) {
  for (char c : token) {
    if (c <= 32 || c >= 127) {
      return Status(Code::kInvalidArgument,
                    "the HTTP access token from " + from +
                        " has a character that cannot go in an HTTP header (a space, control "
                        "character or non-ASCII byte)");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string HttpToken::For(std::string_view origin) const {
  if (token.empty()) return "";
  if (every_origin) return token;
  const std::string want = Lower(origin);
  return std::find(origins.begin(), origins.end(), want) != origins.end() ? token : "";
}

Result<HttpToken> ResolveHttpToken(const std::string& option, const GetEnv& env) {
  HttpToken t;
  if (!option.empty()) {
    t.token = Trimmed(option);
    t.from = "the http_token option";
    t.every_origin = true;
    TF_RETURN_IF_ERROR(CheckPrintable(t.token, t.from));
    return t;
  }
  t.origins = {"https://huggingface.co", "https://hf.co"};
  if (std::optional<std::string> endpoint = env("HF_ENDPOINT")) {
    // A mirror's origin (a path after it is allowed; one that is not a URL adds nothing).
    Result<ObjectUrl> url = ParseObjectUrl(*endpoint);
    if (url.ok() && !IsBucketScheme(url->scheme)) t.origins.push_back(Lower(url->origin));
  }
  if (std::optional<std::string> v = env("HF_TOKEN")) {
    t.token = Trimmed(*v);
    t.from = "HF_TOKEN";
  } else {
    std::string path;
    if (std::optional<std::string> p = env("HF_TOKEN_PATH")) {
      path = *p;
    } else if (std::optional<std::string> home = env("HF_HOME")) {
      path = *home + "/token";
    } else if (std::optional<std::string> cache = env("XDG_CACHE_HOME")) {
      path = *cache + "/huggingface/token";
    } else if (std::optional<std::string> user = env("HOME")) {
      path = *user + "/.cache/huggingface/token";
    }
    if (!path.empty()) {
      Result<std::string> text = ReadSmallFile(path, "Hugging Face token file");
      if (!text.ok() && text.status().code() != Code::kNotFound) return text.status();
      if (text.ok()) {
        t.token = Trimmed(*text);
        t.from = path;
      }
    }
  }
  if (!t.token.empty()) {
    TF_RETURN_IF_ERROR(CheckPrintable(t.token, t.from));
  }
  return t;
}

}  // namespace tensorferry::objstore
