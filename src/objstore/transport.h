// Internal: how many ranged GETs to keep in flight, and how large, for the objects of one source.
//
// A store on this host (reached over loopback, or at an address of one of this host's network
// interfaces) shares the client's CPUs: every further connection costs both sides CPU and adds no
// bandwidth, so a few large GETs are best (8 of 32 MiB). A remote store limits each connection's
// throughput (tens to a few hundred MB/s on S3), so many GETs in flight fill the link (32 of
// 8 MiB). ObjectStoreOptions::concurrency / part_size set (non-zero) win over either.
//
// Contract: pure functions except IsAddressOfThisHost, which reads this host's interface list
// (getifaddrs) on each call. Safe from any thread.
#pragma once

#include <cstdint>
#include <string>

#include "tensorferry/source.h"

namespace tensorferry::objstore {

inline constexpr unsigned kLocalConcurrency = 8, kRemoteConcurrency = 32;
inline constexpr uint64_t kLocalPartSize = 32u << 20, kRemotePartSize = 8u << 20;

// True when `address` (numeric IPv4 or IPv6, as libcurl reports a connection's peer) is this
// host's: a loopback address (127.0.0.0/8, ::1, and the IPv4-mapped form of 127.0.0.0/8) or one
// assigned to one of this host's network interfaces. False for anything else, unparsable text
// included.
bool IsAddressOfThisHost(const std::string& address);

// The hints for a source whose options say `concurrency` and `part_size` (0: automatic), given the
// first peer address on this host (`local_peer`) and the first elsewhere (`remote_peer`) among the
// objects opened so far ("" for none): the local choice only when objects were opened and all came
// from this host. `reason` says what was chosen and why, naming the address (left empty without
// `explain`: the per-read lookup of the part size).
SourceReadHints ChooseTransport(unsigned concurrency, uint64_t part_size,
                                const std::string& local_peer, const std::string& remote_peer,
                                bool explain = true);

}  // namespace tensorferry::objstore
