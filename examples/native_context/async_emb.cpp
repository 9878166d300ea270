// A native embedding context shaped like the seed's AsyncEmbContext: a C++ object that owns one
// world size's rows and refuses to be reset to another.
//
// What it shares with the seed (and what the lifecycle manager must cope with):
//   * it is constructed for one (rank, world_size, ep_size) and owns the rows of that layout;
//   * reset(rank, world_size) re-forms it for the SAME world size only; any other size throws
//     std::invalid_argument("async_emb world size changed from X to Y");
//   * an invalid rank, world size, or an EP size that is not a power of two is rejected with
//     std::invalid_argument at construction (and at reset);
//   * release() frees the rows (and would free the communicator) at once, whoever still holds a
//     reference to the Python object; the destructor releases too;
//   * process-wide counters of constructions, resets and releases, so a test can tell "built
//     anew" from "reset".
//
// Rows are sharded row-wise over the ep_size owner ranks the way torch.chunk splits a dimension
// (ceil(num_rows / ep_size) rows per owner, in order): the layout elastic_emb's state tiers use.
// Each table has a weight [local_rows, dim] and a row-wise accumulator [local_rows]; both are
// at::Tensors owned by this object, handed out as views so the caller can write them in place.
// The rows live on the device given at construction (CPU, or CUDA in a CUDA build of torch).
// ATen and torch's pybind11 casters only: torch/extension.h would also pull in torch::nn and
// torch::optim, which triples the compile time of this file.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

std::atomic<int64_t> g_constructions{0};
std::atomic<int64_t> g_resets{0};
std::atomic<int64_t> g_releases{0};

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

void check_rank(int64_t rank, int64_t world_size) {
  if (world_size < 1) {
    throw std::invalid_argument("async_emb world size " + std::to_string(world_size) + " must be >= 1");
  }
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("async_emb rank " + std::to_string(rank) + " is outside world size " +
                                std::to_string(world_size));
  }
}

struct Table {
  int64_t num_rows;
  int64_t start;  // first global row this rank owns
  int64_t stop;   // one past the last
  at::Tensor weight;       // [stop - start, dim]
  at::Tensor accumulator;  // [stop - start]
};

class AsyncEmbContext {
 public:
  // tables: (name, num_rows, dim). Rows start as zeros: the caller (or a restore) fills them.
  AsyncEmbContext(int64_t rank, int64_t world_size, int64_t ep_size,
                  const std::vector<std::tuple<std::string, int64_t, int64_t>>& tables, const std::string& device)
      : rank_(rank), world_size_(world_size), ep_size_(ep_size) {
    check_rank(rank, world_size);
    if (!is_power_of_two(ep_size) || ep_size > world_size) {
      throw std::invalid_argument("async_emb ep size " + std::to_string(ep_size) +
                                  " must be a power of two <= world size " + std::to_string(world_size));
    }
    auto opts = at::TensorOptions().dtype(at::kFloat).device(at::Device(device));
    for (const auto& [name, num_rows, dim] : tables) {
      if (num_rows < 1 || dim < 1) {
        throw std::invalid_argument("async_emb table " + name + " needs num_rows >= 1 and dim >= 1, got " +
                                    std::to_string(num_rows) + " x " + std::to_string(dim));
      }
      const int64_t per = (num_rows + ep_size - 1) / ep_size;
      const int64_t start = rank < ep_size ? std::min(rank * per, num_rows) : num_rows;
      const int64_t stop = rank < ep_size ? std::min(start + per, num_rows) : num_rows;
      tables_[name] = Table{num_rows, start, stop, at::zeros({stop - start, dim}, opts),
                            at::zeros({stop - start}, opts)};
    }
    ++g_constructions;
  }

  ~AsyncEmbContext() { release(); }

  // Idempotent. After it, every other method throws.
  void release() {
    if (released_) return;
    released_ = true;
    tables_.clear();
    ++g_releases;
  }

  // Same world size only (the ranks may be renumbered). The seed's rule, verbatim.
  void reset(int64_t rank, int64_t world_size) {
    check_live();
    if (world_size != world_size_) {
      throw std::invalid_argument("async_emb world size changed from " + std::to_string(world_size_) + " to " +
                                  std::to_string(world_size));
    }
    check_rank(rank, world_size);
    if (rank != rank_) {
      // A renumbered rank owns other rows: this object's rows would be the wrong ones.
      throw std::invalid_argument("async_emb reset to rank " + std::to_string(rank) + " from rank " +
                                  std::to_string(rank_) + " would change the rows this context owns");
    }
    ++resets_;
    ++g_resets;
  }

  std::pair<int64_t, int64_t> owned(const std::string& table) const {
    const auto& t = find(table);
    return {t.start, t.stop};
  }
  int64_t num_rows(const std::string& table) const { return find(table).num_rows; }
  at::Tensor weight(const std::string& table) { return find(table).weight; }
  at::Tensor accumulator(const std::string& table) { return find(table).accumulator; }
  std::vector<std::string> tables() const {
    std::vector<std::string> out;
    for (const auto& kv : tables_) out.push_back(kv.first);
    return out;
  }

  // A stand-in for a training step whose result is exact in fp32 (small integers): every owned
  // row r gains (r + step) % 5 - 2 in each column, and its accumulator 1.
  void train_step(int64_t step) {
    check_live();
    for (auto& kv : tables_) {
      Table& t = kv.second;
      if (t.stop == t.start) continue;
      auto rows = at::arange(t.start, t.stop, t.weight.options().dtype(at::kLong));
      auto delta = ((rows + step).remainder(5) - 2).to(t.weight.scalar_type());
      t.weight.add_(delta.unsqueeze(1));
      t.accumulator.add_(1);
    }
  }

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  int64_t ep_size() const { return ep_size_; }
  int64_t resets() const { return resets_; }

 private:
  void check_live() const {
    if (released_) throw std::runtime_error("async_emb context was released");
  }
  const Table& find(const std::string& table) const {
    check_live();
    auto it = tables_.find(table);
    if (it == tables_.end()) throw std::out_of_range("async_emb has no table " + table);
    return it->second;
  }
  Table& find(const std::string& table) {
    check_live();
    auto it = tables_.find(table);
    if (it == tables_.end()) throw std::out_of_range("async_emb has no table " + table);
    return it->second;
  }

  int64_t rank_;
  const int64_t world_size_;
  const int64_t ep_size_;
  int64_t resets_ = 0;
  bool released_ = false;
  std::map<std::string, Table> tables_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "A native sharded embedding context with the seed's reset rule (examples/native_context)";
  py::class_<AsyncEmbContext>(m, "AsyncEmbContext")
      .def(py::init<int64_t, int64_t, int64_t, const std::vector<std::tuple<std::string, int64_t, int64_t>>&,
                    const std::string&>(),
           py::arg("rank"), py::arg("world_size"), py::arg("ep_size"), py::arg("tables"), py::arg("device") = "cpu")
      .def("reset", &AsyncEmbContext::reset, py::arg("rank"), py::arg("world_size"))
      .def("release", &AsyncEmbContext::release)
      .def("owned", &AsyncEmbContext::owned)
      .def("num_rows", &AsyncEmbContext::num_rows)
      .def("weight", &AsyncEmbContext::weight)
      .def("accumulator", &AsyncEmbContext::accumulator)
      .def("tables", &AsyncEmbContext::tables)
      .def("train_step", &AsyncEmbContext::train_step)
      .def_property_readonly("rank", &AsyncEmbContext::rank)
      .def_property_readonly("world_size", &AsyncEmbContext::world_size)
      .def_property_readonly("ep_size", &AsyncEmbContext::ep_size)
      .def_property_readonly("resets", &AsyncEmbContext::resets);
  m.def("counters", []() {
    return std::map<std::string, int64_t>{{"constructions", g_constructions.load()},
                                          {"resets", g_resets.load()},
                                          {"releases", g_releases.load()}};
  });
}
