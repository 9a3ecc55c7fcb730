// The transport's automatic settings (transport.h).
#include "objstore/transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstring>

#include "tensorferry/size.h"

namespace tensorferry::objstore {

namespace {

bool Loopback4(const in_addr& a) {
  return (ntohl(a.s_addr) >> 24) == 127;
}

}  // namespace

bool IsAddressOfThisHost(const std::string& address) {
  in_addr v4{};
  in6_addr v6{};
  bool is_v4 = false;
  if (::inet_pton(AF_INET, address.c_str(), &v4) == 1) {
    is_v4 = true;
  } else if (::inet_pton(AF_INET6, address.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_V4MAPPED(&v6)) {  // ::ffff:a.b.c.d is the IPv4 address a.b.c.d
      std::memcpy(&v4, &v6.s6_addr[12], sizeof(v4));
      is_v4 = true;
    }
  } else {
    return false;
  }
  if (is_v4 ? Loopback4(v4) : IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;
  bool found = false;
  for (const ifaddrs* a = list; a != nullptr && !found; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    if (is_v4 && a->ifa_addr->sa_family == AF_INET) {
      found = reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == v4.s_addr;
    } else if (!is_v4 && a->ifa_addr->sa_family == AF_INET6) {
      const in6_addr& mine = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr;
      found = std::memcmp(&mine, &v6, sizeof(mine)) == 0;
    }
  }
  ::freeifaddrs(list);
  return found;
}

SourceReadHints ChooseTransport(unsigned concurrency, uint64_t part_size,
                                const std::string& local_peer, const std::string& remote_peer,
                                bool explain) {
  SourceReadHints h{concurrency, part_size, ""};
  if (concurrency == 0 || part_size == 0) {
    const bool here = !local_peer.empty() && remote_peer.empty();
    if (h.concurrency == 0) h.concurrency = here ? kLocalConcurrency : kRemoteConcurrency;
    if (h.read_size == 0) h.read_size = here ? kLocalPartSize : kRemotePartSize;
  }
  if (!explain) return h;
  std::string why;
  if (concurrency != 0 && part_size != 0) {
    why = "as set";
  } else {
    if (!local_peer.empty() && remote_peer.empty()) {
      why = "the store is on this host (" + local_peer +
            "): fewer, larger GETs spare the CPUs it shares with the loader";
    } else if (!remote_peer.empty()) {
      why = "the store is elsewhere (" + remote_peer + "): many GETs in flight fill the link";
    } else {
      why = "no object opened yet";
    }
    if (concurrency != 0) why += "; the count as set";
    if (part_size != 0) why += "; the size as set";
  }
  h.reason = std::to_string(h.concurrency) + " GETs of " + FormatBytes(h.read_size) +
             " in flight (" + why + ")";
  return h;
}

}  // namespace tensorferry::objstore
