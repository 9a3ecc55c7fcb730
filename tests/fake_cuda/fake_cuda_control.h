/* The control interface of the fake CUDA runtime and cuFile (libtensorferry_fake_cudart.so).
 *
 * Besides the C functions of libcudart and libcufile that tensorferry calls, the fake exports
 * these functions, which tests look up with dlsym on the same handle: configure fault injection and
 * delays, read the accounting (bytes of "device" and pinned memory, live objects, copies) and the
 * violations it detected (a host pointer used as a device pointer, an async copy from memory that
 * is not pinned, a staging buffer overwritten before its copy ran, memory freed under a pending
 * copy, ...). docs/gpu.md describes the model.
 *
 * Plain C so that the fake and its users share one declaration. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct TfFakeCudaConfig {
  int device_count;             /* devices reported (0: cudaGetDeviceCount fails, no device) */
  int device_count_error;       /* nonzero: cudaGetDeviceCount returns this error instead */
  uint64_t device_memory;       /* bytes per device; cudaMalloc beyond fails (out of memory) */
  uint32_t copy_delay_us;       /* each async copy sleeps this long on its stream first */
  int reject_pageable;          /* nonzero: async copies from unpinned host memory fail */
  int64_t fail_host_alloc_at;   /* the n-th cudaHostAlloc call fails (1-based; 0: never) */
  int64_t fail_copy_enqueue_at; /* the n-th cudaMemcpyAsync/2DAsync call fails at once */
  int64_t fail_copy_execute_at; /* the n-th copy fails on its stream (cudaErrorIllegalAddress) */
  int cufile_driver_open_error; /* nonzero: cuFileDriverOpen returns this CU_FILE_* code */
  int cufile_handle_register_error; /* nonzero: cuFileHandleRegister returns this code */
  int64_t cufile_fail_read_at;      /* the n-th cuFileRead fails with -1 / errno EIO */
  /* Nonzero: async copies go through one copy engine of this many bytes per second, shared by
   * every stream (as host-to-device copies share the PCIe link): a copy of n bytes takes n /
   * copy_bytes_per_second of wall time, starting when the engine finished the copies queued on any
   * stream before it. 0: copies take the time of a memcpy. For measuring overlap (the device
   * pipeline's benchmark); not a model of DMA beyond that. */
  uint64_t copy_bytes_per_second;
} TfFakeCudaConfig;

typedef struct TfFakeCudaStats {
  uint64_t device_bytes_in_use;
  uint64_t peak_device_bytes;
  uint64_t device_allocations_live;
  uint64_t device_allocations_total;
  uint64_t pinned_bytes_in_use; /* cudaHostAlloc'd plus cudaHostRegister'd */
  uint64_t peak_pinned_bytes;
  uint64_t pinned_allocations_live;
  uint64_t streams_live;
  uint64_t events_live;
  uint64_t copies_enqueued;
  uint64_t copies_executed;
  uint64_t copies_2d;
  uint64_t bytes_copied_to_device;
  uint64_t max_copies_pending; /* most copies enqueued and not yet executed at one time */
  uint64_t pageable_copies;    /* async copies whose source was not pinned */
  uint64_t violations;
  uint64_t cufile_drivers_open;
  uint64_t cufile_handles_live;
  uint64_t cufile_buffers_registered_live;
  uint64_t cufile_buf_register_calls;
  uint64_t cufile_reads;
  uint64_t cufile_bytes_read;
  /* Bit d: device d's primary context was created since the reset, as CUDA 12 creates it:
   * cudaSetDevice(d), or a call that needs the current device's context (cudaMalloc, cudaFree,
   * stream and event creation) with d current. cuDevicePrimaryCtxGetState reports it. */
  uint64_t contexts_active_mask;
  uint64_t host_alloc_failures; /* cudaHostAlloc calls failed by fail_host_alloc_at */
} TfFakeCudaStats;

/* Fills `config` with the defaults: 1 device, 1 GiB, no delay, no bandwidth limit, pageable copies
 * rejected, no faults. */
void tf_fake_cuda_default_config(TfFakeCudaConfig* config);
/* Applies `config` (NULL: the defaults) and zeroes the counters and violations. Live objects
 * (allocations, streams, events) stay and keep being counted. */
void tf_fake_cuda_reset(const TfFakeCudaConfig* config);
void tf_fake_cuda_stats(TfFakeCudaStats* stats);
/* Copies the violations recorded since the last reset, one per line, into `buffer` (truncated,
 * NUL-terminated) and returns how many there were. */
size_t tf_fake_cuda_violations(char* buffer, size_t size);

typedef void (*TfFakeCudaDefaultConfigFn)(TfFakeCudaConfig*);
typedef void (*TfFakeCudaResetFn)(const TfFakeCudaConfig*);
typedef void (*TfFakeCudaStatsFn)(TfFakeCudaStats*);
typedef size_t (*TfFakeCudaViolationsFn)(char*, size_t);

#ifdef __cplusplus
}
#endif
