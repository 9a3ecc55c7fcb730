// Test-only: runs the tensorferry CLI as a child process, for the end-to-end tests beside it
// (cli_test.cc, doctor_test.cc). Header-only: the tests binary defines TENSORFERRY_CLI_PATH when
// the CLI is built, and only these tests include this header.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "testing/test_util.h"

extern char** environ;

namespace tensorferry::testing {

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs the CLI with `args` in the current environment changed by `env` (a value of nullopt unsets
// the variable), stdin from /dev/null, stdout and stderr captured through files (no pipe
// deadlocks). The CLI must never hang: a run past 60 s is killed and fails the test.
inline RunResult RunCli(const std::vector<std::string>& args,
                        const std::map<std::string, std::optional<std::string>>& env = {}) {
  TempDir io;
  const std::string out_path = io.Join("stdout"), err_path = io.Join("stderr");
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (!env.contains(entry.substr(0, entry.find('=')))) env_storage.push_back(entry);
  }
  for (const auto& [name, value] : env) {
    if (value) env_storage.push_back(name + "=" + *value);
  }
  std::vector<char*> envp;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_storage = {TENSORFERRY_CLI_PATH};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&actions, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  pid_t pid = 0;
  RunResult result;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn " << argv[0] << ": " << std::strerror(rc);
    return result;
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid || (done < 0 && errno != EINTR)) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "CLI still running after 60 s; killed";
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else {
    ADD_FAILURE() << "CLI died with signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    result.exit_code = 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  }
  result.out = ReadBytes(out_path);
  result.err = ReadBytes(err_path);
  return result;
}

// Exit code, stdout and stderr of a run, for failure messages.
inline std::string Describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\n--- stdout:\n" + r.out + "\n--- stderr:\n" +
         r.err;
}

}  // namespace tensorferry::testing
