// Implements the hub-cache half of integrity.h: SHA-256 of whole files (OpenSSL's EVP, Debian's
// libssl-dev) and the snapshot -> blob resolution of a Hugging Face hub cache.
#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "tensorferry/integrity.h"
#include "util/unique_fd.h"

namespace tensorferry {
namespace {

struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* ctx) const noexcept { EVP_MD_CTX_free(ctx); }
};

bool IsLowerHex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

Result<std::string> Sha256OfFile(const std::string& path) {
  const UniqueFd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (file.get() < 0) {
    const int err = errno;
    return Status(err == ENOENT ? Code::kNotFound : Code::kIoError,
                  path + ": open: " + std::strerror(err));
  }
  ::posix_fadvise(file.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx(EVP_MD_CTX_new());
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    return Status(Code::kInternal, path + ": OpenSSL could not start a SHA-256 digest");
  }
  std::vector<unsigned char> buffer(4u << 20);
  uint64_t offset = 0;
  for (;;) {
    const ssize_t n = ::pread(file.get(), buffer.data(), buffer.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status(Code::kIoError, path + ": read at offset " + std::to_string(offset) + ": " +
                                        std::strerror(errno));
    }
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), buffer.data(), static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(ctx.get(), digest, &length) != 1) {
    return Status(Code::kInternal, path + ": OpenSSL could not finish a SHA-256 digest");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * length);
  for (unsigned i = 0; i < length; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 0xf];
  }
  return hex;
}

std::optional<std::pair<std::string, std::string>> HubCacheBlob(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_symlink(path, ec)) return std::nullopt;
  const std::filesystem::path resolved = std::filesystem::canonical(path, ec);
  if (ec) return std::nullopt;
  const std::string name = resolved.filename().string();
  if (resolved.parent_path().filename() != "blobs" || name.size() != 64 || !IsLowerHex(name)) {
    return std::nullopt;
  }
  return std::make_pair(resolved.string(), name);
}

}  // namespace tensorferry
