// Under mpirun (tests/mpi/run.sh NP tensorferry_mpi_test): every rank loads its slices of a small
// generated checkpoint cooperatively over MPI and checks it byte for byte against the oracle
// slicing of the full tensors (read independently), and that the ranks together read every byte
// exactly once, each the bytes AssignReaders gives it; and against the independent per-rank
// sliced path (LoadOptions::tensor_parallel). Exit 0 when every rank passed.
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>

#include "tensorferry/cooperative.h"
#include "tensorferry/mpi.h"
#include "testing/shard_fixture.h"
#include "testing/test_util.h"

namespace tensorferry {
namespace {

int failures = 0;

void Expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

std::string Bytes(const Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data()), t.size());
}

void Run(Collective& c, const std::string& path, const LoadOptions& options) {
  const uint32_t me = c.rank();
  const uint32_t world = c.size();
  auto checkpoint = Checkpoint::Open(path).ValueOrThrow();
  const std::vector<Tensor> full = Loader::Open(checkpoint).ValueOrThrow()->Load().ValueOrThrow();
  const ShardSpec spec = testing::ShardFixtureSpec();
  CooperativeStats stats;
  auto result = LoadCooperative(checkpoint, Selection::All(), spec, options, c, &stats);
  Expect(result.ok(), "LoadCooperative: " + result.status().ToString());
  if (!result.ok()) return;
  // The plan every rank made (one host here: every rank under one mpirun on this machine).
  const std::vector<uint32_t> hosts = HostsOfRanks(c).ValueOrThrow();
  const CooperativePlan plan =
      PlanCooperative(*checkpoint, Selection::All(), spec, options, hosts).ValueOrThrow();
  uint64_t exchanged_bytes = 0, exchanged_count = 0;
  for (const CooperativeTensorPlan& t : plan.tensors) {
    exchanged_count += t.exchanged ? 1 : 0;
    exchanged_bytes += t.exchanged ? checkpoint->tensors()[t.tensor].size : 0;
  }
  Expect(stats.hosts == plan.hosts && stats.exchanged_tensors == exchanged_count,
         "the load's plan differs from PlanCooperative's");
  const uint64_t expected_read = plan.ExchangedBytesReadBy(*checkpoint, me);
  for (size_t i = 0; i < full.size(); ++i) {
    const TensorInfo& info = checkpoint->tensors()[i];
    const uint64_t elements =
        std::accumulate(info.shape.begin(), info.shape.end(), uint64_t{1}, std::multiplies<>());
    const uint64_t elem = elements == 0 ? 1 : info.size / elements;
    const std::string want =
        testing::OracleSlice(Bytes(full[i]), info.shape, elem, spec.RuleFor(info.name), me, world);
    Expect(Bytes((*result)[i]) == want, info.name + " on rank " + std::to_string(me));
  }
  // The independent per-rank sliced path (LoadOptions::tensor_parallel) gives the same tensors.
  LoadOptions independent_options = options;
  independent_options.tensor_parallel = TensorParallelOptions{spec, me, world};
  independent_options.budget = 0;  // Load returns everything at once
  const std::vector<Tensor> theirs =
      Loader::Open(checkpoint, independent_options).ValueOrThrow()->Load().ValueOrThrow();
  Expect(theirs.size() == result->size(), "independent path: tensor count");
  for (size_t i = 0; i < theirs.size() && i < result->size(); ++i) {
    Expect(theirs[i].shape() == (*result)[i].shape() && Bytes(theirs[i]) == Bytes((*result)[i]),
           "independent path differs at " + theirs[i].name() + " on rank " + std::to_string(me));
  }
  // Exactly its share of the exchanged tensors, plus its own parts of the local ones.
  const bool all_exchanged = exchanged_count == plan.tensors.size();
  Expect(all_exchanged ? stats.bytes_read == expected_read : stats.bytes_read > expected_read,
         "rank " + std::to_string(me) + " read " + std::to_string(stats.bytes_read) +
             " bytes, its share of the exchanged tensors is " + std::to_string(expected_read));
  auto all = c.AllGather(expected_read).ValueOrThrow();
  const uint64_t total = std::accumulate(all.begin(), all.end(), uint64_t{0});
  Expect(total == exchanged_bytes,
         "the ranks read " + std::to_string(total) + " bytes of exchanged tensors, not each once");
}

// Arguments one member gets wrong end the call on every member with kInvalidArgument, before any
// transfer (the others would wait in it forever); the communicator still works afterwards.
void ArgumentErrorsEndEveryMember(Collective& c) {
  if (c.size() < 2) return;
  const uint32_t last = c.size() - 1;
  const std::string me = "rank " + std::to_string(c.rank());
  const std::string payload = "tensorferry";
  std::string into(payload.size() + (c.rank() == last ? 1 : 0), '\0');
  Status s = c.Broadcast(std::as_bytes(std::span<const char>(payload)),
                         std::as_writable_bytes(std::span<char>(into)), 0);
  Expect(s.code() == Code::kInvalidArgument,
         "Broadcast, a wrong size on the last rank: " + me + " got " + s.ToString());
  if (c.rank() != last && c.rank() != 0) {
    Expect(s.message().find("rank " + std::to_string(last) + " refused") != std::string::npos,
           "Broadcast: " + me + " does not name the rank at fault: " + s.ToString());
  }
  std::vector<uint64_t> counts(c.size(), 3);
  if (c.rank() == last) counts[0] = 4;  // the counts differ on one member
  std::string block(counts[c.rank()], '\0');
  const std::string blocks(c.rank() == 0 ? 3 * c.size() : 0, 'x');
  s = c.Scatterv(std::as_bytes(std::span<const char>(blocks)), counts,
                 std::as_writable_bytes(std::span<char>(block)), 0);
  Expect(s.code() == Code::kInvalidArgument,
         "Scatterv, other counts on the last rank: " + me + " got " + s.ToString());
  std::string again(payload.size(), '\0');
  s = c.Broadcast(std::as_bytes(std::span<const char>(payload)),
                  std::as_writable_bytes(std::span<char>(again)), 0);
  Expect(s.ok() && (c.rank() == 0 || again == payload),
         "Broadcast after the refused calls: " + me + " got " + s.ToString());
}

int Main() {
  auto c = MpiCollective::Create(MPI_COMM_WORLD).ValueOrThrow();
  // Rank 0 writes the checkpoint and tells the others where.
  std::unique_ptr<testing::TempDir> dir;
  std::string path;
  if (c->rank() == 0) {
    dir = std::make_unique<testing::TempDir>();
    ThrowIfError(testing::WriteShardFixture(dir->path()));
    path = dir->path();
  }
  const uint64_t length = c->AllGather(path.size()).ValueOrThrow()[0];
  std::string received(length, '\0');
  ThrowIfError(c->Broadcast(std::as_bytes(std::span<const char>(path)),
                            std::as_writable_bytes(std::span<char>(received)), 0));
  if (c->rank() != 0) path = received;
  ArgumentErrorsEndEveryMember(*c);

  for (Engine engine : {Engine::kPread, Engine::kMmap}) {
    for (uint64_t budget : {uint64_t{0}, uint64_t{1500}}) {
      for (ExchangeChoice choice : {ExchangeChoice::kAll, ExchangeChoice::kAuto}) {
        LoadOptions options;
        options.engine = engine;
        options.budget = budget;
        options.threads = 1;
        options.cooperative.exchange = choice;
        Run(*c, path, options);
      }
    }
  }
  // Every rank keeps the directory until all are done.
  ThrowIfError(c->Barrier());
  int mine = failures;
  int all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (c->rank() == 0) {
    std::printf("%s: %d rank(s), %d failure(s)\n", all == 0 ? "PASSED" : "FAILED",
                static_cast<int>(c->size()), all);
  }
  return all == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tensorferry

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 1;
  try {
    rc = tensorferry::Main();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
