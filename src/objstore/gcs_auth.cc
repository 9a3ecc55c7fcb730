// Google Cloud Storage settings and OAuth 2 tokens (gcs_auth.h).
#include "objstore/gcs_auth.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <simdjson.h>

#include <algorithm>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "objstore/credentials_common.h"
#include "objstore/url.h"
#include "util/json_dom.h"
#include "util/json_writer.h"
#include "util/macros.h"

namespace tensorferry::objstore {
namespace {

constexpr size_t kMaxTokenResponse = 64 << 10;

Result<std::string> Required(const std::map<std::string, std::string>& fields, const char* name,
                             const std::string& source, const std::string& type) {
  auto it = fields.find(name);
  if (it == fields.end() || it->second.empty()) {
    return Status(Code::kInvalidArgument,
                  source + ": a \"" + type + "\" credentials file needs \"" + name + "\"");
  }
  return it->second;
}

std::string Optional(const std::map<std::string, std::string>& fields, const char* name,
                     const std::string& fallback = "") {
  auto it = fields.find(name);
  return it == fields.end() || it->second.empty() ? fallback : it->second;
}

}  // namespace

Status ParseGcsCredentials(std::string_view text, const std::string& source, GcsConfig& c) {
  TF_ASSIGN_OR_RETURN(const auto fields, StringMembers(text, source));
  const std::string type = Optional(fields, "type");
  c.token_uri = Optional(fields, "token_uri", kGoogleTokenUri);
  if (type == "authorized_user") {
    TF_ASSIGN_OR_RETURN(c.client_id, Required(fields, "client_id", source, type));
    TF_ASSIGN_OR_RETURN(c.client_secret, Required(fields, "client_secret", source, type));
    TF_ASSIGN_OR_RETURN(c.refresh_token, Required(fields, "refresh_token", source, type));
    c.token_kind = GcsTokenKind::kAuthorizedUser;
  } else if (type == "service_account") {
    TF_ASSIGN_OR_RETURN(c.client_email, Required(fields, "client_email", source, type));
    TF_ASSIGN_OR_RETURN(c.private_key, Required(fields, "private_key", source, type));
    c.private_key_id = Optional(fields, "private_key_id");
    c.token_kind = GcsTokenKind::kServiceAccount;
  } else if (type.empty()) {
    return Status(Code::kInvalidArgument, source +
                                              ": no \"type\" (a Google credentials file says "
                                              "\"authorized_user\" or \"service_account\")");
  } else {
    return Status(Code::kUnsupported,
                  source + ": credentials of type \"" + type +
                      "\" are not read (authorized_user and service_account are; or give a "
                      "token: the gcs_token option or GOOGLE_OAUTH_ACCESS_TOKEN)");
  }
  if (c.token_kind != GcsTokenKind::kNone) {
    Result<ObjectUrl> uri = ParseObjectUrl(c.token_uri);
    if (!uri.ok() || IsBucketScheme(uri->scheme)) {
      c.token_kind = GcsTokenKind::kNone;
      return Status(Code::kInvalidArgument,
                    source + ": token_uri \"" + c.token_uri + "\" is not an http(s) URL");
    }
    c.token_uri = uri->ToString();  // the scheme lower-cased
  }
  c.s3.credentials_from = type + " " + source;
  return Status::Ok();
}

namespace {

// Reads an Application Default Credentials file into `c`.
Status ReadCredentialsFile(GcsConfig& c, const std::string& path, const std::string& named_by) {
  TF_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, "credentials file"));
  c.credentials_file = path;
  return ParseGcsCredentials(text, path + " (" + named_by + ")", c);
}

bool SaysGoogleVm(const std::string& dmi_product_file) {
  if (dmi_product_file.empty()) return false;
  Result<std::string> text = ReadSmallFile(dmi_product_file, "DMI product name");
  return text.ok() && text->find("Google") != std::string::npos;
}

Status ResolveCredentials(GcsConfig& c, const GcsRequest& r, const GetEnv& env,
                          const std::string& dmi_product_file) {
  if (r.anonymous == 1) {
    c.s3.anonymous = true;
    c.s3.credentials_from = "options: anonymous";
    return Status::Ok();
  }
  if (!r.access_key_id.empty() || !r.secret_access_key.empty()) {
    if (r.access_key_id.empty() || r.secret_access_key.empty()) {
      return Status(Code::kInvalidArgument,
                    "GCS HMAC key from options: give both the access key id and the secret");
    }
    c.s3.access_key_id = r.access_key_id;
    c.s3.secret_access_key = r.secret_access_key;
    c.s3.credentials_from = "options (HMAC key)";
    return Status::Ok();
  }
  c.s3.anonymous = true;  // no SigV4: a bearer token, or nothing
  // A given token goes into a header as is: trailing whitespace (a file read whole) is dropped,
  // any other byte a header cannot hold is refused, naming where it came from (never the token).
  const auto given = [&c](std::string token, const std::string& from) -> Status {
    while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ' ||
                              token.back() == '\t')) {
      token.pop_back();
    }
    for (char ch : token) {
      if (static_cast<unsigned char>(ch) <= ' ' || static_cast<unsigned char>(ch) >= 127) {
        return Status(Code::kInvalidArgument,
                      "GCS token from " + from +
                          ": it has a character not allowed in an HTTP header (a line break or "
                          "space inside it?)");
      }
    }
    c.token_kind = GcsTokenKind::kStatic;
    c.token = std::move(token);
    c.s3.credentials_from = from;
    return Status::Ok();
  };
  if (!r.token.empty()) return given(r.token, "options (token)");
  if (auto token = Env(env, "GOOGLE_OAUTH_ACCESS_TOKEN")) {
    return given(*token, "environment (GOOGLE_OAUTH_ACCESS_TOKEN)");
  }
  if (auto path = Env(env, "GOOGLE_APPLICATION_CREDENTIALS")) {
    Status s = ReadCredentialsFile(c, *path, "GOOGLE_APPLICATION_CREDENTIALS");
    if (s.code() == Code::kNotFound) {
      return Status(Code::kNotFound,
                    "GOOGLE_APPLICATION_CREDENTIALS names " + *path + ", which does not exist");
    }
    return s;
  }
  std::string gcloud_dir;
  if (auto dir = Env(env, "CLOUDSDK_CONFIG")) {
    gcloud_dir = *dir;
  } else if (auto home = Env(env, "HOME")) {
    gcloud_dir = *home + "/.config/gcloud";
  }
  if (!gcloud_dir.empty()) {
    const std::string adc = gcloud_dir + "/application_default_credentials.json";
    Status s = ReadCredentialsFile(c, adc, "gcloud's application default credentials");
    if (s.ok() || s.code() != Code::kNotFound) return s;
  }
  std::optional<std::string> metadata = Env(env, "GCE_METADATA_HOST");
  if (metadata || SaysGoogleVm(dmi_product_file)) {
    c.token_kind = GcsTokenKind::kMetadata;
    c.metadata_host = metadata.value_or("metadata.google.internal");
    c.s3.credentials_from = "metadata server " + c.metadata_host +
                            (metadata ? " (GCE_METADATA_HOST)" : " (a Google Compute Engine VM)");
    return Status::Ok();
  }
  if (r.anonymous == 0) {
    return Status(Code::kInvalidArgument,
                  "no GCS credentials found (options, GOOGLE_OAUTH_ACCESS_TOKEN, "
                  "GOOGLE_APPLICATION_CREDENTIALS, gcloud's application default credentials, a "
                  "metadata server) and anonymous access was turned off");
  }
  c.s3.credentials_from = "none found: anonymous";
  return Status::Ok();
}

// The error a token endpoint sent, as text: OAuth's {"error", "error_description"} or Google's
// {"error": {"message"}}, else an excerpt.
std::string TokenError(const HttpResponse& r) {
  std::string out = "HTTP " + std::to_string(r.status);
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (ParseJson(parser, r.text, root) == simdjson::SUCCESS) {
    std::string_view error, description, message;
    if (root["error"].get(error) == simdjson::SUCCESS) {
      out += " " + std::string(error);
      if (root["error_description"].get(description) == simdjson::SUCCESS) {
        out += ": " + std::string(description);
      }
      return out;
    }
    if (root["error"]["message"].get(message) == simdjson::SUCCESS) {
      return out + ": " + std::string(message);
    }
  }
  const std::string excerpt = Excerpt(r.text);
  return excerpt.empty() ? out : out + ": " + excerpt;
}

}  // namespace

Result<GcsConfig> ResolveGcsConfig(const GcsRequest& request, const GetEnv& env,
                                   const std::string& dmi_product_file) {
  GcsConfig c;
  if (!request.endpoint.empty()) {
    TF_ASSIGN_OR_RETURN(c.s3.endpoint, NormalizeEndpoint(request.endpoint, "options", "GCS"));
    c.s3.endpoint_from = "options";
  } else {
    c.s3.endpoint = kGcsDefaultEndpoint;
    c.s3.endpoint_from = "GCS default";
  }
  c.s3.region = request.region.empty() ? "auto" : request.region;
  c.s3.region_from = request.region.empty() ? "GCS" : "options";
  c.s3.path_style = true;
  c.s3.path_style_auto = false;
  TF_RETURN_IF_ERROR(ResolveCredentials(c, request, env, dmi_product_file));
  return c;
}

// --- tokens --------------------------------------------------------------------------------------

Result<std::shared_ptr<BearerTokens>> BearerTokens::Make(const GcsConfig& config,
                                                         const HttpSettings& transport) {
  if (config.token_kind == GcsTokenKind::kNone) return std::shared_ptr<BearerTokens>();
  // One per credential and transport in the process: every source opened with the same
  // credentials (each file beside a model, each load) shares its token instead of asking again.
  return SharedPerProcess<BearerTokens>(
      {&config.token, &config.token_uri, &config.client_id, &config.client_secret,
       &config.refresh_token, &config.client_email, &config.private_key, &config.private_key_id,
       &config.metadata_host},
      static_cast<int>(config.token_kind), transport,
      [&]() -> Result<std::shared_ptr<BearerTokens>> {
        std::unique_ptr<HttpClient> client;
        if (config.token_kind != GcsTokenKind::kStatic) {
          TF_ASSIGN_OR_RETURN(client, CredentialsClient(transport));
        }
        return std::shared_ptr<BearerTokens>(new BearerTokens(config, std::move(client)));
      });
}

BearerTokens::BearerTokens(GcsConfig config, std::unique_ptr<HttpClient> client)
    : config_(std::move(config)), client_(std::move(client)) {}

BearerTokens::~BearerTokens() = default;

Result<std::string> BearerTokens::Get() {
  if (config_.token_kind == GcsTokenKind::kStatic) return config_.token;
  return tokens_.Get([this]() -> Result<Refreshing<std::string>::Fetched> {
    TF_ASSIGN_OR_RETURN(auto fetched, Fetch());
    return Refreshing<std::string>::Fetched{std::move(fetched.first), fetched.second};
  });
}

bool BearerTokens::Refuse(const std::string& token) {
  if (config_.token_kind == GcsTokenKind::kStatic) return false;
  tokens_.ForgetIf([&](const std::string& held) { return held == token; });
  return true;
}

uint64_t BearerTokens::fetches() const {
  return tokens_.fetches();
}

Result<std::pair<std::string, std::chrono::seconds>> BearerTokens::Fetch() const {
  HttpRequest req;
  req.text_limit = kMaxTokenResponse;
  const std::string& uri =
      config_.token_kind == GcsTokenKind::kMetadata ? config_.metadata_host : config_.token_uri;
  if (config_.token_kind == GcsTokenKind::kMetadata) {
    req.url = "http://" + config_.metadata_host +
              "/computeMetadata/v1/instance/service-accounts/default/token";
    req.headers.push_back("Metadata-Flavor: Google");
  } else {
    req.url = uri;
    req.headers.push_back("Content-Type: application/x-www-form-urlencoded");
    if (config_.token_kind == GcsTokenKind::kAuthorizedUser) {
      req.post_body = FormEncode({{"grant_type", "refresh_token"},
                                  {"client_id", config_.client_id},
                                  {"client_secret", config_.client_secret},
                                  {"refresh_token", config_.refresh_token}});
    } else {
      const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
      TF_ASSIGN_OR_RETURN(const std::string assertion, ServiceAccountAssertion(config_, now));
      req.post_body = FormEncode({{"grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer"},
                                  {"assertion", assertion}});
    }
  }
  const std::string where =
      "GCS credentials (" + config_.s3.credentials_from + "): token request to " + req.url;
  const HttpResponse r = AskCredentialsEndpoint(*client_, req);
  // A fetch its caller's load cancelled (the transfer, or the backoff after a 5xx): kCancelled,
  // which the callers waiting for this fetch do not take as their own error (they fetch again).
  if (r.cancelled) return Status(Code::kCancelled, where + ": the load was cancelled");
  if (r.status == 0) {
    return Status(Code::kIoError, where + ": no response (" + r.curl_error + ")");
  }
  if (r.status != 200) {
    return Status(Code::kIoError, where + ": " + TokenError(r));
  }
  return ParseTokenAnswer(r.text, where);
}

Result<std::pair<std::string, std::chrono::seconds>> ParseTokenAnswer(std::string_view text,
                                                                      const std::string& where) {
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  std::string_view token;
  if (ParseJson(parser, text, root) != simdjson::SUCCESS ||
      root["access_token"].get(token) != simdjson::SUCCESS || token.empty()) {
    return Status(Code::kIoError, where + ": the answer has no \"access_token\"");
  }
  for (char ch : token) {
    if (ch <= ' ' || ch >= 127) {
      return Status(Code::kIoError, where +
                                        ": the access token has a character not allowed in "
                                        "an HTTP header");
    }
  }
  int64_t expires_in = 3600;
  if (root["expires_in"].get(expires_in) != simdjson::SUCCESS || expires_in <= 0) {
    expires_in = 3600;
  }
  return std::pair(std::string(token), std::chrono::seconds(std::min<int64_t>(expires_in, 86400)));
}

// --- JWT -----------------------------------------------------------------------------------------

std::string Base64Url(std::string_view bytes) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<uint8_t>(bytes[i])} << 16) |
                       (uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8) |
                       uint32_t{static_cast<uint8_t>(bytes[i + 2])};
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  const size_t rest = bytes.size() - i;
  if (rest > 0) {
    uint32_t v = uint32_t{static_cast<uint8_t>(bytes[i])} << 16;
    if (rest == 2) v |= uint32_t{static_cast<uint8_t>(bytes[i + 1])} << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    if (rest == 2) out += kAlphabet[(v >> 6) & 63];
  }
  return out;
}

Result<std::string> SignRs256(std::string_view pem, std::string_view signing_input) {
  const auto bad = [](std::string what) {
    return Status(Code::kInvalidArgument, "the service account's private_key: " + what);
  };
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  if (bio == nullptr) return bad("out of memory");
  // No passphrase is ever asked for: without a callback OpenSSL prompts on the terminal (a load
  // would hang on "Enter PEM pass phrase:"); Google's key files are never encrypted.
  pem_password_cb* no_passphrase = [](char*, int, int, void*) { return -1; };
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr), &EVP_PKEY_free);
  if (key == nullptr) {
    ERR_clear_error();  // the failure's queue is ours to empty, not the next OpenSSL user's
    if (pem.find("ENCRYPTED") != std::string_view::npos) {
      return bad(
          "an encrypted (passphrase-protected) PEM key, which tensorferry does not "
          "decrypt; Google's service-account key files hold a plain one");
    }
    return bad("not a PEM private key");
  }
  if (EVP_PKEY_get_base_id(key.get()) != EVP_PKEY_RSA) return bad("not an RSA key");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  size_t length = 0;
  const auto* data = reinterpret_cast<const unsigned char*>(signing_input.data());
  if (ctx == nullptr ||
      EVP_DigestSignInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key.get()) != 1 ||
      EVP_DigestSign(ctx.get(), nullptr, &length, data, signing_input.size()) != 1) {
    return bad("signing failed");
  }
  std::string signature(length, '\0');
  if (EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(signature.data()), &length, data,
                     signing_input.size()) != 1) {
    return bad("signing failed");
  }
  signature.resize(length);
  return Base64Url(signature);
}

Result<std::string> ServiceAccountAssertion(const GcsConfig& config, int64_t now_seconds) {
  std::string header = R"({"alg":"RS256","typ":"JWT")";
  if (!config.private_key_id.empty()) header += ",\"kid\":" + json::Quote(config.private_key_id);
  header += "}";
  std::string claims = "{\"iss\":" + json::Quote(config.client_email) +
                       ",\"scope\":" + json::Quote(kGcsReadScope) +
                       ",\"aud\":" + json::Quote(config.token_uri) + ",\"iat\":";
  json::AppendUint(claims, static_cast<uint64_t>(now_seconds));
  claims += ",\"exp\":";
  json::AppendUint(claims, static_cast<uint64_t>(now_seconds + 3600));
  claims += "}";
  const std::string signing_input = Base64Url(header) + "." + Base64Url(claims);
  Result<std::string> signature = SignRs256(config.private_key, signing_input);
  if (!signature.ok()) {
    return signature.status().WithPrefix(
        config.credentials_file.empty() ? std::string("GCS credentials") : config.credentials_file);
  }
  return signing_input + "." + *signature;
}

}  // namespace tensorferry::objstore
