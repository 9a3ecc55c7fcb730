// The automatic transport (transport.h): which addresses are this host's, and what each case
// chooses.
#include "objstore/transport.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <string>
#include <vector>

namespace tensorferry::objstore {
namespace {

// This host's interface addresses other than loopback, as text.
std::vector<std::string> InterfaceAddresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    char text[INET6_ADDRSTRLEN] = {0};
    if (a->ifa_addr->sa_family == AF_INET) {
      const in_addr& x = reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr;
      if ((ntohl(x.s_addr) >> 24) == 127) continue;
      ::inet_ntop(AF_INET, &x, text, sizeof text);
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      const in6_addr& x = reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LOOPBACK(&x)) continue;
      ::inet_ntop(AF_INET6, &x, text, sizeof text);
    } else {
      continue;
    }
    out.emplace_back(text);
  }
  ::freeifaddrs(list);
  return out;
}

TEST(TransportTest, LoopbackAddressesAreThisHosts) {
  for (const char* a : {"127.0.0.1", "127.1.2.3", "127.255.255.254", "::1", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(IsAddressOfThisHost(a)) << a;
  }
}

TEST(TransportTest, InterfaceAddressesAreThisHosts) {
  const std::vector<std::string> mine = InterfaceAddresses();
  if (mine.empty()) GTEST_SKIP() << "no network interface besides loopback";
  for (const std::string& a : mine) EXPECT_TRUE(IsAddressOfThisHost(a)) << a;
}

TEST(TransportTest, OtherAddressesAndTextAreNot) {
  // Documentation ranges (RFC 5737, RFC 3849): assigned to no host.
  for (const char* a : {"192.0.2.1", "198.51.100.7", "2001:db8::1", "::ffff:192.0.2.1", "128.0.0.1",
                        "", "localhost", "127.0.0.1:9000", "[::1]", "127.0.0.1 ", "::1%lo"}) {
    EXPECT_FALSE(IsAddressOfThisHost(a)) << "\"" << a << "\"";
  }
}

TEST(TransportTest, AutomaticChoiceFollowsWhereTheObjectsCameFrom) {
  const SourceReadHints here = ChooseTransport(0, 0, "127.0.0.1", "");
  EXPECT_EQ(here.concurrency, kLocalConcurrency);
  EXPECT_EQ(here.read_size, kLocalPartSize);
  EXPECT_EQ(here.reason,
            "8 GETs of 33.55 MB in flight (the store is on this host (127.0.0.1): fewer, larger "
            "GETs spare the CPUs it shares with the loader)");

  const SourceReadHints away = ChooseTransport(0, 0, "", "192.0.2.1");
  EXPECT_EQ(away.concurrency, kRemoteConcurrency);
  EXPECT_EQ(away.read_size, kRemotePartSize);
  EXPECT_NE(away.reason.find("elsewhere (192.0.2.1)"), std::string::npos) << away.reason;

  // One object from elsewhere is enough: the remote store's per-connection limit decides.
  const SourceReadHints mixed = ChooseTransport(0, 0, "127.0.0.1", "192.0.2.1");
  EXPECT_EQ(mixed.concurrency, kRemoteConcurrency);
  EXPECT_EQ(mixed.read_size, kRemotePartSize);

  // Without the explanation (the per-read lookup): the same values, no text.
  const SourceReadHints quiet = ChooseTransport(0, 0, "127.0.0.1", "", /*explain=*/false);
  EXPECT_EQ(quiet.concurrency, here.concurrency);
  EXPECT_EQ(quiet.read_size, here.read_size);
  EXPECT_TRUE(quiet.reason.empty());

  // Nothing opened yet (no peer known): the remote choice, which never starves a remote link.
  const SourceReadHints none = ChooseTransport(0, 0, "", "");
  EXPECT_EQ(none.concurrency, kRemoteConcurrency);
  EXPECT_NE(none.reason.find("no object opened yet"), std::string::npos) << none.reason;
}

TEST(TransportTest, SetValuesWinEachOnItsOwn) {
  const SourceReadHints both = ChooseTransport(4, 1u << 20, "127.0.0.1", "");
  EXPECT_EQ(both.concurrency, 4u);
  EXPECT_EQ(both.read_size, 1u << 20);
  EXPECT_EQ(both.reason, "4 GETs of 1.05 MB in flight (as set)");

  const SourceReadHints count = ChooseTransport(16, 0, "127.0.0.1", "");
  EXPECT_EQ(count.concurrency, 16u);
  EXPECT_EQ(count.read_size, kLocalPartSize);
  EXPECT_NE(count.reason.find("; the count as set"), std::string::npos) << count.reason;

  const SourceReadHints size = ChooseTransport(0, 4u << 20, "", "192.0.2.1");
  EXPECT_EQ(size.concurrency, kRemoteConcurrency);
  EXPECT_EQ(size.read_size, 4u << 20);
  EXPECT_NE(size.reason.find("; the size as set"), std::string::npos) << size.reason;
}

}  // namespace
}  // namespace tensorferry::objstore
