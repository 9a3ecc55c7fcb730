// tensorferry: inspect, verify and generate safetensors checkpoints.
//
//   tensorferry inspect PATH [--json] [--all]
//   tensorferry verify PATH [--json]
//   tensorferry gen OUT [--preset tiny|small|default|large] [--layers N] ... [--json]
//   tensorferry convert SRC DST [--max-shard-size SIZE] [--verify] [--json]
//   tensorferry doctor [--json] [--quick]
//
// Exit codes (commands.h): 0 success; 1 an I/O error, invalid input or an invalid TENSORFERRY_*
// variable; 2 a usage error (the command line's). Ended by SIGINT, SIGTERM
// or SIGHUP, it first removes the temporary files of writes in progress (and undoes a sharded
// write not yet committed), then dies of the signal as it would without a handler. Before it
// exits, copies into object caches still in progress (a load from object storage is done before
// its cache's copy is) are finished (a signal then gives them up; FinishObjectCacheCopies).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "commands.h"
#include "tensorferry/mapping.h"
#include "tensorferry/object_store.h"
#include "tensorferry/options.h"
#include "tensorferry/writer.h"

#ifndef TENSORFERRY_VERSION_STRING
#define TENSORFERRY_VERSION_STRING "unknown"
#endif

namespace {

// The signal being handled by OnTerminatingSignal (0: none yet).
std::atomic<int> g_terminating{0};

// Async-signal-safe: AbandonWritesInProgress uses only unlink, rename and atomics; the rest is
// sigaction, sigprocmask, raise and pause. The first SIGINT, SIGTERM or SIGHUP runs the cleanup;
// one arriving meanwhile (`timeout` signals the child, then its process group; or on another
// thread: reshard, load and checksum work on several) waits for it instead of ending the process
// half way through. Then the default disposition is restored and the signal raised and unblocked:
// the process dies of it, and the exit status says which signal it was.
extern "C" void OnTerminatingSignal(int sig) {
  int none = 0;
  if (!g_terminating.compare_exchange_strong(none, sig)) {
    for (;;) ::pause();  // the first handler ends the process
  }
  tensorferry::AbandonWritesInProgress();
  struct sigaction defaults {};
  defaults.sa_handler = SIG_DFL;
  sigemptyset(&defaults.sa_mask);
  ::sigaction(sig, &defaults, nullptr);
  ::raise(sig);  // pending while this handler blocks it
  sigset_t unblock;
  sigemptyset(&unblock);
  sigaddset(&unblock, sig);
  ::sigprocmask(SIG_UNBLOCK, &unblock, nullptr);
  ::_exit(128 + sig);  // (not reached: the signal's default ends the process)
}

// `handler` for SIGINT, SIGTERM and SIGHUP, the three blocked while it runs; with `once`
// (SA_RESETHAND), a second signal finds the default disposition.
void InstallSignalHandlers(void (*handler)(int), bool once) {
  struct sigaction action {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&action.sa_mask, sig);
  action.sa_flags = once ? SA_RESETHAND : 0;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old {};
    // A signal the parent ignores (nohup, a shell's background job) stays ignored.
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    ::sigaction(sig, &action, nullptr);
  }
}

// The copies into object caches still in progress when the command ended (a load from object
// storage is done before its cache's copy is): waited for, in steps so that a signal is seen. The
// first SIGINT, SIGTERM or SIGHUP gives them up (each removed; the next load of its file
// downloads it again), waits up to 10 s for their requests in flight, and the process dies of
// the signal; a second one ends it at once. Copies that failed are reported, one line each.
volatile sig_atomic_t g_exit_signal = 0;

extern "C" void OnSignalWhileCopying(int sig) {
  g_exit_signal = sig;
}

void FinishObjectCacheCopies() {
  if (tensorferry::ObjectCachesCopying()) {
    if (::isatty(STDERR_FILENO) != 0) {
      std::fputs("tensorferry: finishing the copies into the cache (Ctrl-C gives them up)...\n",
                 stderr);
    }
    InstallSignalHandlers(OnSignalWhileCopying, /*once=*/true);
    while (!tensorferry::WaitForObjectCaches(std::chrono::milliseconds(100))) {
      const int sig = g_exit_signal;
      if (sig == 0) continue;
      tensorferry::AbandonObjectCaches();
      std::fputs(
          "tensorferry: the copies into the cache were given up; the next load downloads "
          "them again\n",
          stderr);
      tensorferry::WaitForObjectCaches(std::chrono::seconds(10));
      ::signal(sig, SIG_DFL);
      ::raise(sig);
    }
  }
  for (const std::string& failure : tensorferry::TakeObjectCacheFailures()) {
    const std::string line =
        "tensorferry: warning: " + failure + " (the next load downloads it again)\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tensorferry::cli;
  InstallSignalHandlers(OnTerminatingSignal, /*once=*/false);
  // An output past the file-size limit (ulimit -f) fails its write with EFBIG, so the writers'
  // rollback removes what they wrote; SIGXFSZ's default would kill the process mid-write.
  ::signal(SIGXFSZ, SIG_IGN);
  try {
    CLI::App app{"tensorferry: inspect, verify and generate safetensors checkpoints"};
    app.name("tensorferry");
    app.set_version_flag("--version", std::string("tensorferry ") + TENSORFERRY_VERSION_STRING);
    app.require_subcommand(1);
    std::vector<Command> commands = {
        AddInspectCommand(app), AddVerifyCommand(app),   AddGenCommand(app),
        AddLoadCommand(app),    AddBenchCommand(app),    AddDoctorCommand(app),
        AddReshardCommand(app), AddChecksumCommand(app), AddCacheCommand(app)};
#ifdef TENSORFERRY_WITH_CONVERT  // the convert component (libzip) was built
    commands.push_back(AddConvertCommand(app));
#endif
    // An option given an empty value ("--budget \"$UNSET\"") is a usage error, never taken as
    // "not given" (the default) nor as a value.
    const CLI::Validator non_empty(
        [](std::string& value) {
          return value.empty() ? std::string("an empty value is not allowed") : std::string();
        },
        "", "NON_EMPTY");
    for (const Command& command : commands) {
      for (CLI::Option* option : command.app->get_options()) {
        if (option->get_expected_min() > 0) option->check(non_empty);
      }
    }
    // A first word that is neither an option nor a command: name it and the commands (CLI11
    // would only say that a subcommand is required).
    if (argc > 1 && argv[1][0] != '-') {
      std::string names;
      bool known = false;
      for (const Command& command : commands) {
        known = known || command.app->check_name(argv[1]);
        names += (names.empty() ? "" : ", ") + command.app->get_name();
      }
      if (!known) {
        return UsageError(std::string("unknown command '") + argv[1] + "' (commands: " + names +
                          "; --help explains them)");
      }
    }
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      // --help and --version are "errors" with exit code 0; everything else is a usage error.
      const int code = app.exit(e);
      return code == 0 ? kExitOk : kExitUsage;
    }
    // A misspelt setting (TENSORFERRY_BUGDET) would otherwise be ignored without a word.
    for (const std::string& unknown : tensorferry::UnknownEnvironmentVariables()) {
      const std::string line = "tensorferry: warning: " + unknown + "\n";
      std::fputs(line.c_str(), stderr);
    }
    for (const Command& command : commands) {
      if (!command.app->parsed()) continue;
      int rc = command.run();
      // A mapped file shrank under tensors this command used (no lease could guard it): whatever
      // it printed from them is wrong, so it must not exit 0.
      if (const tensorferry::Status mapped = tensorferry::CheckMappedFiles(); !mapped.ok()) {
        PrintError(mapped.ToString());
        if (rc == kExitOk) rc = kExitError;
      }
      FinishObjectCacheCopies();
      return rc;
    }
    return kExitUsage;  // unreachable: require_subcommand(1)
  } catch (const std::bad_alloc&) {
    PrintError("out of memory");
  } catch (const std::exception& e) {
    PrintError(std::string("internal error: ") + e.what());
  } catch (...) {
    PrintError("internal error: unknown exception");
  }
  return kExitError;
}
