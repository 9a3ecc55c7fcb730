// A "CUDA runtime" that lacks most functions: tests check that loading it fails with
// kCudaSymbolMissing naming the library and the first missing function (cudaSetDevice).
#define TF_FAKE_EXPORT extern "C" __attribute__((visibility("default")))

TF_FAKE_EXPORT int cudaGetDeviceCount(int* count) {
  *count = 1;
  return 0;
}

TF_FAKE_EXPORT const char* cudaGetErrorString(int) {
  return "unknown error";
}
