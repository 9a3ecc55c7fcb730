// libFuzzer target: the bytes are a whole torch.save file, zip or legacy. TorchCheckpoint::Open
// must never crash, hang or read outside the file; every tensor of what it accepts must be
// readable in full (or fail with a status), through an in-memory Env.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tensorferry/convert.h"
#include "tensorferry/env.h"

namespace {

class BytesFile final : public tensorferry::RandomAccessFile {
 public:
  BytesFile(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  tensorferry::Result<size_t> Read(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset >= size_) return size_t{0};
    const size_t n = static_cast<size_t>(std::min<uint64_t>(dst.size(), size_ - offset));
    if (n > 0) std::memcpy(dst.data(), data_ + offset, n);
    return n;
  }
  tensorferry::Result<uint64_t> Size() const override { return uint64_t{size_}; }
  const std::string& path() const noexcept override { return path_; }

 private:
  const uint8_t* data_;
  size_t size_;
  std::string path_ = "fuzz.pt";
};

class BytesEnv final : public tensorferry::Env {
 public:
  BytesEnv(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  tensorferry::Result<std::unique_ptr<tensorferry::RandomAccessFile>> OpenRandomAccess(
      const std::string& path) override {
    if (path != "fuzz.pt") return tensorferry::Status(tensorferry::Code::kNotFound, path);
    return std::unique_ptr<tensorferry::RandomAccessFile>(new BytesFile(data_, size_));
  }

 private:
  const uint8_t* data_;
  size_t size_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  BytesEnv env(data, size);
  tensorferry::TorchOpenOptions options;
  options.env = &env;
  options.limits.pickle.max_pickle_size = 1 << 20;
  options.limits.pickle.max_objects = 1 << 16;
  options.limits.pickle.max_total_items = 1 << 18;
  options.limits.max_zip_entries = 1 << 12;
  auto c = tensorferry::TorchCheckpoint::Open("fuzz.pt", options);
  if (!c.ok()) {
    if (c.status().message().empty()) std::abort();
    return 0;
  }
  std::vector<std::byte> buf(4096);
  for (size_t i = 0; i < (*c)->tensors().size(); ++i) {
    const auto& t = (*c)->tensors()[i];
    // Materialized tensors may be far larger than their storage (stride 0); read a bounded part.
    const uint64_t n = std::min<uint64_t>(t.byte_size, 1 << 16);
    for (uint64_t off = 0; off < n; off += buf.size()) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(buf.size(), n - off));
      if (!(*c)->ReadTensor(i, off, std::span<std::byte>(buf.data(), len)).ok()) break;
    }
    if (t.storage >= (*c)->storages().size()) std::abort();
  }
  // The CRC-32 of the entries read in part: an error or ok, never a crash.
  static_cast<void>((*c)->CheckStoragesRead());
  return 0;
}
