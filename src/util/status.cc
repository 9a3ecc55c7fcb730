#include "tensorferry/status.h"

namespace tensorferry {

Category CategoryOf(Code code) noexcept {
  switch (code) {
    case Code::kOk: return Category::kOk;
    case Code::kIoError:
    case Code::kUnexpectedEof:
    case Code::kAccessDenied: return Category::kIo;
    case Code::kNotFound: return Category::kNotFound;
    case Code::kInvalidArgument:
    case Code::kBadTensorName:
    case Code::kBadTensorData: return Category::kInvalidArgument;
    case Code::kUnsupported:
    case Code::kPickleUnsupportedOpcode:
    case Code::kPickleRefusedGlobal:
    case Code::kPickleRefusedCall:
    case Code::kTorchUnsupportedDtype:
    case Code::kTorchNotStateDict: return Category::kUnsupported;
    case Code::kBudgetExceeded: return Category::kBudget;
    case Code::kCudaError: return Category::kCuda;
    case Code::kInternal: return Category::kInternal;
    case Code::kCancelled: return Category::kCancelled;
    case Code::kCudaNotFound:
    case Code::kCudaSymbolMissing:
    case Code::kCudaNoDevice:
    case Code::kGdsUnavailable: return Category::kUnsupported;
    case Code::kDeviceOutOfMemory:
    case Code::kCufileError: return Category::kCuda;
    case Code::kChecksumMismatch:
    case Code::kChecksumsInvalid: return Category::kCorrupt;
    default: break;
  }
  const auto v = static_cast<uint16_t>(code);
  if (v >= 100 && v < 300) return Category::kCorrupt;
  if (v >= 400 && v < 500) return Category::kCorrupt;
  return Category::kInternal;
}

std::string_view CodeName(Code code) noexcept {
  switch (code) {
    case Code::kOk: return "ok";
    case Code::kIoError: return "io_error";
    case Code::kNotFound: return "not_found";
    case Code::kInvalidArgument: return "invalid_argument";
    case Code::kUnsupported: return "unsupported";
    case Code::kBudgetExceeded: return "budget_exceeded";
    case Code::kCudaError: return "cuda_error";
    case Code::kInternal: return "internal";
    case Code::kUnexpectedEof: return "unexpected_eof";
    case Code::kCancelled: return "cancelled";
    case Code::kAccessDenied: return "access_denied";
    case Code::kTooManyMetadataEntries: return "too_many_metadata_entries";
    case Code::kCheckpointTooLarge: return "checkpoint_too_large";
    case Code::kFileTooSmall: return "file_too_small";
    case Code::kHeaderTooLarge: return "header_too_large";
    case Code::kHeaderOutOfBounds: return "header_out_of_bounds";
    case Code::kHeaderBom: return "header_bom";
    case Code::kHeaderNotUtf8: return "header_not_utf8";
    case Code::kHeaderInvalidJson: return "header_invalid_json";
    case Code::kHeaderNotObject: return "header_not_object";
    case Code::kHeaderTooDeep: return "header_too_deep";
    case Code::kTooManyTensors: return "too_many_tensors";
    case Code::kDuplicateKey: return "duplicate_key";
    case Code::kReservedName: return "reserved_name";
    case Code::kMetadataNotObject: return "metadata_not_object";
    case Code::kMetadataNotString: return "metadata_not_string";
    case Code::kTensorNotObject: return "tensor_not_object";
    case Code::kMissingField: return "missing_field";
    case Code::kUnknownDtype: return "unknown_dtype";
    case Code::kInvalidShape: return "invalid_shape";
    case Code::kRankTooLarge: return "rank_too_large";
    case Code::kInvalidOffsets: return "invalid_offsets";
    case Code::kOffsetsReversed: return "offsets_reversed";
    case Code::kPartialByte: return "partial_byte";
    case Code::kSizeMismatch: return "size_mismatch";
    case Code::kOverflow: return "overflow";
    case Code::kDataGap: return "data_gap";
    case Code::kDataOverlap: return "data_overlap";
    case Code::kDataTrailing: return "data_trailing";
    case Code::kDataTruncated: return "data_truncated";
    case Code::kIndexInvalidJson: return "index_invalid_json";
    case Code::kIndexNoWeightMap: return "index_no_weight_map";
    case Code::kIndexBadEntry: return "index_bad_entry";
    case Code::kIndexPathEscape: return "index_path_escape";
    case Code::kIndexMissingTensor: return "index_missing_tensor";
    case Code::kIndexUnlistedTensor: return "index_unlisted_tensor";
    case Code::kIndexDuplicateTensor: return "index_duplicate_tensor";
    case Code::kIndexMissingFile: return "index_missing_file";
    case Code::kIndexTooLarge: return "index_too_large";
    case Code::kCheckpointIncomplete: return "checkpoint_incomplete";
    case Code::kBadTensorName: return "bad_tensor_name";
    case Code::kBadTensorData: return "bad_tensor_data";
    case Code::kPickleTruncated: return "pickle_truncated";
    case Code::kPickleMalformed: return "pickle_malformed";
    case Code::kPickleUnsupportedOpcode: return "pickle_unsupported_opcode";
    case Code::kPickleRefusedGlobal: return "pickle_refused_global";
    case Code::kPickleRefusedCall: return "pickle_refused_call";
    case Code::kPickleLimitExceeded: return "pickle_limit_exceeded";
    case Code::kPickleBadPersistentId: return "pickle_bad_persistent_id";
    case Code::kTorchBadTensor: return "torch_bad_tensor";
    case Code::kTorchUnsupportedDtype: return "torch_unsupported_dtype";
    case Code::kTorchMissingStorage: return "torch_missing_storage";
    case Code::kZipInvalid: return "zip_invalid";
    case Code::kZipBadEntry: return "zip_bad_entry";
    case Code::kTorchBadArchive: return "torch_bad_archive";
    case Code::kTorchNameConflict: return "torch_name_conflict";
    case Code::kTorchLegacyInvalid: return "torch_legacy_invalid";
    case Code::kTorchNotStateDict: return "torch_not_state_dict";
    case Code::kConvertVerifyMismatch: return "convert_verify_mismatch";
    case Code::kCudaNotFound: return "cuda_not_found";
    case Code::kCudaSymbolMissing: return "cuda_symbol_missing";
    case Code::kCudaNoDevice: return "cuda_no_device";
    case Code::kDeviceOutOfMemory: return "device_out_of_memory";
    case Code::kGdsUnavailable: return "gds_unavailable";
    case Code::kCufileError: return "cufile_error";
    case Code::kChecksumMismatch: return "checksum_mismatch";
    case Code::kChecksumsInvalid: return "checksums_invalid";
  }
  return "unknown";
}

std::string_view CategoryName(Category category) noexcept {
  switch (category) {
    case Category::kOk: return "ok";
    case Category::kIo: return "io";
    case Category::kNotFound: return "not_found";
    case Category::kCorrupt: return "corrupt";
    case Category::kInvalidArgument: return "invalid_argument";
    case Category::kUnsupported: return "unsupported";
    case Category::kBudget: return "budget";
    case Category::kCuda: return "cuda";
    case Category::kInternal: return "internal";
    case Category::kCancelled: return "cancelled";
  }
  return "unknown";
}

Status::Status(Code code, std::string message) {
  if (code != Code::kOk) rep_ = std::make_shared<const Rep>(Rep{code, std::move(message)});
}

const std::string& Status::message() const noexcept {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string s(CodeName(rep_->code));
  s += ": ";
  s += rep_->message;
  return s;
}

Status Status::WithPrefix(std::string_view prefix) const {
  if (ok() || prefix.empty()) return *this;
  std::string m(prefix);
  m += ": ";
  m += rep_->message;
  return Status(rep_->code, std::move(m));
}

}  // namespace tensorferry
