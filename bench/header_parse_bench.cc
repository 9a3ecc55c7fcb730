// Times header parsing of one safetensors file, in process, after a warm-up:
//   parse: ParseHeader over bytes already in memory (the pure parser)
//   open:  Checkpoint::Open (open, read the header through Env, parse, build the table)
// Prints one JSON object. Usage: tf_header_parse_bench FILE [ITERATIONS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tensorferry/checkpoint.h"
#include "tensorferry/env.h"
#include "tensorferry/format.h"

using Clock = std::chrono::steady_clock;

static double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE [ITERATIONS]\n", argv[0]);
    return 2;
  }
  const std::string path = argv[1];
  const int iters = argc > 2 ? std::max(1, std::atoi(argv[2])) : 11;
#ifndef NDEBUG
  std::fprintf(stderr, "warning: debug build; timings are not meaningful\n");
#endif
  auto file = tensorferry::Env::Default()->OpenRandomAccess(path);
  if (!file.ok()) {
    std::fprintf(stderr, "error: %s\n", file.status().ToString().c_str());
    return 1;
  }
  auto size = (*file)->Size();
  std::vector<std::byte> prefix(8);
  if (auto s = tensorferry::ReadFully(**file, 0, prefix); !s.ok() || !size.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  auto n = tensorferry::ParseHeaderLength(prefix, *size, {}, path);
  if (!n.ok()) {
    std::fprintf(stderr, "error: %s\n", n.status().ToString().c_str());
    return 1;
  }
  std::vector<std::byte> head(8 + *n);
  if (auto s = tensorferry::ReadFully(**file, 0, head); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  std::vector<double> parse_s, open_s;
  size_t tensors = 0;
  for (int i = 0; i <= iters; ++i) {  // iteration 0 is the warm-up
    auto t0 = Clock::now();
    auto h = tensorferry::ParseHeader(head, *size, {}, path);
    auto t1 = Clock::now();
    if (!h.ok()) {
      std::fprintf(stderr, "error: %s\n", h.status().ToString().c_str());
      return 1;
    }
    tensors = h->tensors.size();
    auto c = tensorferry::Checkpoint::Open(path);
    auto t2 = Clock::now();
    if (!c.ok()) {
      std::fprintf(stderr, "error: %s\n", c.status().ToString().c_str());
      return 1;
    }
    if (i == 0) continue;
    parse_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    open_s.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  const double p = Median(parse_s), o = Median(open_s);
  std::printf(
      "{\"file\":\"%s\",\"tensors\":%zu,\"header_bytes\":%llu,\"iterations\":%d,"
      "\"parse_median_s\":%.6f,\"parse_min_s\":%.6f,\"parse_max_s\":%.6f,\"parse_tensors_per_s\":%."
      "0f,"
      "\"open_median_s\":%.6f,\"open_min_s\":%.6f,\"open_max_s\":%.6f,\"open_tensors_per_s\":%.0f}"
      "\n",
      path.c_str(), tensors, static_cast<unsigned long long>(*n), iters, p,
      *std::min_element(parse_s.begin(), parse_s.end()),
      *std::max_element(parse_s.begin(), parse_s.end()), tensors / p, o,
      *std::min_element(open_s.begin(), open_s.end()),
      *std::max_element(open_s.begin(), open_s.end()), tensors / o);
  return 0;
}
