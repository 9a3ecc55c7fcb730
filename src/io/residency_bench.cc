// tf_residency_bench FILE...: what the page-cache residency check (CachedFraction) costs per file,
// every page against the default sampling (io::ResidencySampling), and how far the estimate lands
// from the full count. Each file is checked `--repeat` times per mode, the modes alternating;
// medians are printed. The check runs once per load (the O_DIRECT choice, the tensor-parallel
// exact/gather choice), so its cost is part of every load's time. docs/benchmarks.md,
// "Residency checks".
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "io/read_engine.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 5;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--repeat") == 0 && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else {
      files.emplace_back(argv[i]);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: tf_residency_bench [--repeat N] FILE...\n");
    return 2;
  }
  tensorferry::io::ResidencySampling every;
  every.above_pages = UINT64_MAX;
  const tensorferry::io::ResidencySampling sampled;
  double total_every = 0, total_sampled = 0;
  std::printf("%-60s %10s %10s %9s %9s\n", "file", "every ms", "sampled ms", "every", "sampled");
  for (const std::string& path : files) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      std::perror(path.c_str());
      return 1;
    }
    std::vector<double> ms[2];
    double fraction[2] = {0, 0};
    for (int r = 0; r < repeat; ++r) {
      for (int mode = 0; mode < 2; ++mode) {
        const auto t0 = std::chrono::steady_clock::now();
        auto f = tensorferry::io::CachedFraction(fd, path, 0, UINT64_MAX / 2,
                                                 mode == 0 ? every : sampled);
        ms[mode].push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
        if (!f.ok()) {
          std::fprintf(stderr, "%s\n", f.status().ToString().c_str());
          return 1;
        }
        fraction[mode] = *f;
      }
    }
    ::close(fd);
    total_every += Median(ms[0]);
    total_sampled += Median(ms[1]);
    std::printf("%-60s %10.2f %10.2f %9.3f %9.3f\n", path.c_str(), Median(ms[0]), Median(ms[1]),
                fraction[0], fraction[1]);
  }
  std::printf("%-60s %10.2f %10.2f\n", "total", total_every, total_sampled);
  return 0;
}
