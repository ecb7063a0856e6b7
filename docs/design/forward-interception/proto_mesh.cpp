// proto_mesh.cpp -- prototype: ZeRO-3/FSDP `fully_shard` and tensor-parallel Linear on PLAIN libtorch 1.13
// modules, without touching the user's forward(), using a free post-autograd dispatch key (DispatchKey::Fake)
// on the parameter TensorImpls plus one boxed fallback.
//
// Two "ranks" = two std::threads in one process; collectives are simulated by SimPG (barrier + shared slots,
// sums taken in rank order so every rank gets bit-identical results).  torch intra-op threads = 1.
//
// Build: ./build.sh proto_mesh.cpp      Run: ./proto_mesh
#include <torch/torch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <mutex>
#include <shared_mutex>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>

namespace mp {
constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;  // unused by libtorch 1.13 core (torchdistx's out-of-tree key)

// ------------------------------------------------------------------ simulated process group
struct SimPG {
  explicit SimPG(int w) : world(w), slots(w) {}
  int world;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  long gen = 0;
  std::vector<at::Tensor> slots;
  long collectives = 0;  // counted by rank 0
  void barrier() {
    std::unique_lock<std::mutex> l(m);
    long g = gen;
    if (++arrived == world) {
      arrived = 0;
      ++gen;
      cv.notify_all();
    } else {
      cv.wait(l, [&] { return gen != g; });
    }
  }
  void all_reduce_sum_(int rank, const at::Tensor& t) {
    if (rank == 0) ++collectives;
    slots[rank] = t;
    barrier();
    at::Tensor acc = slots[0].clone();
    for (int r = 1; r < world; ++r) acc.add_(slots[r]);
    barrier();
    slots[rank].reset();
    t.copy_(acc);
  }
  at::Tensor all_gather_flat(int rank, const at::Tensor& shard) {
    if (rank == 0) ++collectives;
    slots[rank] = shard;
    barrier();
    at::Tensor out = at::cat(slots);
    barrier();
    slots[rank].reset();
    return out;
  }
  at::Tensor reduce_scatter_flat(int rank, const at::Tensor& full) {  // full: [world*L] -> this rank's [L]
    if (rank == 0) ++collectives;
    int64_t L = full.numel() / world;
    slots[rank] = full;
    barrier();
    at::Tensor acc = slots[0].narrow(0, rank * L, L).clone();
    for (int r = 1; r < world; ++r) acc.add_(slots[r].narrow(0, rank * L, L));
    barrier();
    slots[rank].reset();
    return acc;
  }
};

// ------------------------------------------------------------------ marking a tensor with our key
struct KeyHack : c10::TensorImpl {  // member pointer formed through a derived class: legal access to protected key_set_
  static void add(const at::Tensor& t, c10::DispatchKey k) {
    c10::DispatchKeySet c10::TensorImpl::*p = &KeyHack::key_set_;
    auto* impl = t.unsafeGetTensorImpl();
    impl->*p = (impl->*p).add(k);
  }
};

// ------------------------------------------------------------------ registry
struct RankState;
struct Unit {  // one fully_shard() unit == one flat parameter (FSDP FlatParameter)
  std::string name;
  int rank = 0;
  SimPG* pg = nullptr;
  RankState* rs = nullptr;
  std::vector<at::Tensor> params;  // the module's own full-size parameter tensors (storage freed while resharded)
  std::vector<int64_t> offs, numels;
  std::vector<size_t> nbytes;
  int64_t L = 0;                   // shard length
  at::Tensor shard;                // this rank's flat shard: leaf, requires_grad -- what the optimizer updates
  bool gathered = false;
  int grads_ready = 0;
  bool reduced = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accs;  // keep AccumulateGrad nodes (and their hooks) alive
};
struct RankState {
  int rank = 0;
  std::vector<Unit*> units;
  bool cb_queued = false;
  std::vector<std::string>* trace = nullptr;
  long gathers = 0, frees = 0;
};
struct TPEntry {
  int rank;
  SimPG* pg;
  int64_t dim, stride, size;  // shard dim of the local weight, its stride and size
};
struct Entry {
  Unit* unit = nullptr;
  int idx = -1;
  TPEntry* tp = nullptr;
  c10::Storage keep;  // strong ref: a registry keyed by StorageImpl* must never see a recycled address
};
std::shared_mutex g_reg_m;
std::unordered_map<const c10::StorageImpl*, Entry> g_reg;
bool g_tp_comm = true;  // negative control switch

static void trace(RankState* rs, const std::string& s) {
  if (rs->trace) rs->trace->push_back(s);
}

// ------------------------------------------------------------------ FSDP primitives (run with kKey excluded)
static void free_unit(Unit& u) {
  for (auto& p : u.params) {
    auto* s = p.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
    s->set_nbytes(0);
  }
  u.gathered = false;
  ++u.rs->frees;
  trace(u.rs, "free:" + u.name);
}
static void gather_unit(Unit& u) {
  at::Tensor full = u.pg->all_gather_flat(u.rank, u.shard.detach());
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& p = u.params[i];
    auto* s = p.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(c10::GetAllocator(s->device_type())->allocate(u.nbytes[i]));
    s->set_nbytes(u.nbytes[i]);
    at::from_blob(s->data(), {u.numels[i]}, full.options()).copy_(full.narrow(0, u.offs[i], u.numels[i]));
  }
  u.gathered = true;
  ++u.rs->gathers;
  trace(u.rs, "gather:" + u.name);
}
static void write_back(Unit& u, int i) {  // an in-place op modified full param i: copy our part back into the shard
  int64_t lo = std::max<int64_t>(u.offs[i], u.rank * u.L), hi = std::min<int64_t>(u.offs[i] + u.numels[i], (u.rank + 1) * u.L);
  if (lo >= hi) return;
  auto* s = u.params[i].storage().unsafeGetStorageImpl();
  auto src = at::from_blob(s->data(), {u.numels[i]}, u.shard.options().requires_grad(false));
  u.shard.detach().narrow(0, lo - u.rank * u.L, hi - lo).copy_(src.narrow(0, lo - u.offs[i], hi - lo));
  trace(u.rs, "writeback:" + u.name);
}

// ------------------------------------------------------------------ TP: "contracting over a sharded dim => partial sum"
static bool contracts_shard(const at::Tensor& t, bool is_rhs, const TPEntry& e) {
  int64_t d = is_rhs ? (t.dim() == 1 ? 0 : t.dim() - 2) : t.dim() - 1;
  return t.stride(d) == e.stride && t.size(d) == e.size;
}

// ------------------------------------------------------------------ THE fallback
void mesh_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kKey);  // our own helper ops and composite sub-ops are not intercepted
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  std::vector<Unit*> touched;
  std::vector<std::pair<Unit*, int>> written;
  TPEntry* tp = nullptr;
  int tp_arg = -1;
  {
    std::shared_lock<std::shared_mutex> l(g_reg_m);
    auto args = torch::jit::last(*stack, nargs);
    auto visit = [&](const at::Tensor& t, size_t i) {
      if (!t.defined() || !t.has_storage()) return;
      auto it = g_reg.find(t.storage().unsafeGetStorageImpl());
      if (it == g_reg.end()) return;
      if (Unit* u = it->second.unit) {
        if (std::find(touched.begin(), touched.end(), u) == touched.end()) touched.push_back(u);
        const auto* ai = schema.arguments()[i].alias_info();
        if (ai && ai->isWrite()) written.emplace_back(u, it->second.idx);
      }
      if (it->second.tp) {
        tp = it->second.tp;
        tp_arg = static_cast<int>(i);
      }
    };
    for (size_t i = 0; i < nargs; ++i) {
      const auto& iv = args[i];
      if (iv.isTensor()) visit(iv.toTensor(), i);
      else if (iv.isTensorList() || iv.isOptionalTensorList())
        for (const auto& e : iv.toListRef())
          if (e.isTensor()) visit(e.toTensor(), i);
    }
  }
  // ---- ZeRO-3: reshard every other gathered unit of this rank, unshard the touched ones
  if (!touched.empty()) {
    for (Unit* o : touched.front()->rs->units)
      if (o->gathered && std::find(touched.begin(), touched.end(), o) == touched.end()) free_unit(*o);
    for (Unit* u : touched)
      if (!u->gathered) gather_unit(*u);
  }
  // ---- TP: matmul-like op contracting over the local weight's shard dim produces a partial sum -> all-reduce
  if (tp && g_tp_comm) {
    const std::string& name = schema.name();
    bool mmlike = name == "aten::mm" || name == "aten::matmul" || name == "aten::addmm";
    if (mmlike) {
      int lhs = name == "aten::addmm" ? 1 : 0;  // addmm(self=bias, mat1, mat2, beta, alpha)
      auto args = torch::jit::last(*stack, nargs);
      bool partial = (tp_arg == lhs && contracts_shard(args[lhs].toTensor(), false, *tp)) ||
                     (tp_arg == lhs + 1 && contracts_shard(args[lhs + 1].toTensor(), true, *tp));
      if (partial && name == "aten::addmm") {
        at::Tensor bias = args[0].toTensor(), m1 = args[1].toTensor(), m2 = args[2].toTensor();
        at::Scalar beta = args[3].toScalar(), alpha = args[4].toScalar();
        torch::jit::drop(*stack, nargs);
        at::Tensor out = at::mm(m1, m2);
        if (alpha.toDouble() != 1.0) out.mul_(alpha);
        tp->pg->all_reduce_sum_(tp->rank, out);
        out.add_(bias, beta);  // bias added once, after the reduction
        torch::jit::push(*stack, out);
        return;
      }
      if (partial) {
        op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
        tp->pg->all_reduce_sum_(tp->rank, stack->back().toTensor());
        return;
      }
    }
  }
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
  for (auto& w : written) write_back(*w.first, w.second);
}

std::unique_ptr<torch::Library> g_lib;
void install() {
  if (g_lib) return;
  TORCH_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kKey), "key already taken");
  g_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
  g_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&mesh_fallback>());
}

// ------------------------------------------------------------------ zero::fully_shard
static void reduce_unit_grads(Unit& u) {
  at::Tensor flat = at::zeros({u.L * u.pg->world}, u.shard.options().requires_grad(false));
  for (size_t i = 0; i < u.params.size(); ++i) {
    auto& g = u.params[i].mutable_grad();
    if (g.defined()) flat.narrow(0, u.offs[i], u.numels[i]).copy_(g.reshape({-1}));
    g.reset();  // free the full-size gradient right away
  }
  at::Tensor mine = u.pg->reduce_scatter_flat(u.rank, flat).div_(u.pg->world);
  auto& sg = u.shard.mutable_grad();
  if (sg.defined()) sg.add_(mine);
  else sg = mine;
  u.reduced = true;
  u.grads_ready = 0;
  trace(u.rs, "reduce_scatter:" + u.name);
  if (u.gathered) free_unit(u);  // post-backward reshard
}
static void end_of_backward(RankState& rs) {
  c10::impl::ExcludeDispatchKeyGuard g(kKey);
  for (Unit* u : rs.units) {
    if (!u->reduced) reduce_unit_grads(*u);  // units with unused params: same order on every rank
    u->reduced = false;
    if (u->gathered) free_unit(*u);
  }
  rs.cb_queued = false;
}
struct PostAccumulate : torch::autograd::FunctionPostHook {
  Unit* u;
  explicit PostAccumulate(Unit* u) : u(u) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    c10::impl::ExcludeDispatchKeyGuard g(kKey);
    RankState* rs = u->rs;
    if (!rs->cb_queued) {
      rs->cb_queued = true;
      torch::autograd::Engine::get_default_engine().queue_callback([rs] { end_of_backward(*rs); });
    }
    if (++u->grads_ready == static_cast<int>(u->params.size())) reduce_unit_grads(*u);
    return outputs;
  }
};

Unit* fully_shard(torch::nn::Module& m, const std::string& name, int rank, SimPG* pg, RankState& rs) {
  install();
  auto u = new Unit();  // leaked on purpose in the prototype
  u->name = name;
  u->rank = rank;
  u->pg = pg;
  u->rs = &rs;
  {
    std::shared_lock<std::shared_mutex> l(g_reg_m);
    for (auto& p : m.parameters())
      if (!g_reg.count(p.storage().unsafeGetStorageImpl())) u->params.push_back(p);  // children sharded first win
  }
  int64_t total = 0;
  for (auto& p : u->params) {
    TORCH_CHECK(p.is_contiguous() && p.storage_offset() == 0 &&
                p.storage().nbytes() == size_t(p.numel()) * p.element_size(), "prototype: dense params only");
    u->offs.push_back(total);
    u->numels.push_back(p.numel());
    u->nbytes.push_back(p.storage().nbytes());
    total += p.numel();
  }
  u->L = (total + pg->world - 1) / pg->world;
  {
    torch::NoGradGuard ng;
    std::vector<at::Tensor> flat;
    for (auto& p : u->params) flat.push_back(p.detach().reshape({-1}));
    at::Tensor full = at::cat(flat);
    full = at::constant_pad_nd(full, {0, u->L * pg->world - total});
    u->shard = full.narrow(0, rank * u->L, u->L).clone().requires_grad_(true);
  }
  {
    std::unique_lock<std::shared_mutex> l(g_reg_m);
    for (size_t i = 0; i < u->params.size(); ++i) {
      g_reg[u->params[i].storage().unsafeGetStorageImpl()] = Entry{u, static_cast<int>(i), nullptr, u->params[i].storage()};
      KeyHack::add(u->params[i], kKey);
      auto acc = torch::autograd::impl::grad_accumulator(u->params[i]);
      acc->add_post_hook(std::make_unique<PostAccumulate>(u));
      u->accs.push_back(acc);
    }
  }
  u->gathered = true;
  rs.units.push_back(u);
  {
    c10::impl::ExcludeDispatchKeyGuard g(kKey);
    free_unit(*u);  // start resharded
  }
  return u;
}
std::vector<at::Tensor> full_params(Unit& u) {  // collective: explicit materialisation for checks/checkpointing
  c10::impl::ExcludeDispatchKeyGuard g(kKey);
  at::Tensor full = u.pg->all_gather_flat(u.rank, u.shard.detach());
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < u.params.size(); ++i)
    out.push_back(full.narrow(0, u.offs[i], u.numels[i]).view(u.params[i].sizes()).clone());
  return out;
}

// ------------------------------------------------------------------ tp::parallelize (plain torch::nn::Linear)
enum class Style { Colwise, Rowwise };
void parallelize(torch::nn::Linear& lin, Style s, int rank, SimPG* pg) {
  install();
  torch::NoGradGuard ng;
  auto& w = lin->weight;
  auto& b = lin->bias;
  int64_t dim = s == Style::Colwise ? 0 : 1, k = w.size(dim) / pg->world;
  w.set_data(w.narrow(dim, rank * k, k).clone());  // same TensorImpl (module + optimizer refs stay valid), new shape
  if (s == Style::Colwise && b.defined()) b.set_data(b.narrow(0, rank * k, k).clone());  // rowwise: bias replicated
  KeyHack::add(w, kKey);  // AFTER set_data: set_data copies the source's key set
  std::unique_lock<std::shared_mutex> l(g_reg_m);
  g_reg[w.storage().unsafeGetStorageImpl()] = Entry{nullptr, -1, new TPEntry{rank, pg, dim, w.stride(dim), w.size(dim)}, w.storage()};
}
}  // namespace mp

// ==================================================================== user code (unchanged plain modules)
struct BlockImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 32))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(32, 8))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(Block);
struct NetImpl : torch::nn::Module {
  Block b1{register_module("b1", Block())};
  Block b2{register_module("b2", Block())};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(8, 4))};
  torch::Tensor forward(torch::Tensor x) {
    auto h = b1(x);
    h = b2(h) + h;
    return head(h);
  }
};
TORCH_MODULE(Net);

static void copy_params(torch::nn::Module& dst, torch::nn::Module& src) {
  torch::NoGradGuard ng;
  auto d = dst.parameters(), s = src.parameters();
  for (size_t i = 0; i < d.size(); ++i) d[i].copy_(s[i]);
}
static double md(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }
static double g_worst = 0;
static void check(const std::string& what, double v, double tol = 1e-6) {
  g_worst = std::max(g_worst, v);
  std::cout << "  " << (v <= tol ? "OK  " : "FAIL") << " " << what << " maxabs=" << v << "\n";
}

// -------------------------------------------------------------------- (a) ZeRO-3 end to end
static void test_fsdp() {
  std::cout << "=== (a) zero::fully_shard, 2 simulated ranks, 3 SGD steps, alternating 2-D / 3-D batches\n";
  const int W = 2, STEPS = 3;
  const double lr = 0.1;
  torch::manual_seed(0);
  Net ref;
  ref->to(torch::kDouble);
  std::vector<Net> nets;
  for (int r = 0; r < W; ++r) {
    nets.emplace_back();
    nets.back()->to(torch::kDouble);  // BEFORE sharding: Module::to() uses set_data and would drop the key
    copy_params(*nets.back(), *ref);
  }
  std::vector<std::vector<at::Tensor>> data(STEPS);
  for (int s = 0; s < STEPS; ++s)
    for (int r = 0; r < W; ++r)
      data[s].push_back(s % 2 == 0 ? torch::randn({4, 8}, torch::kDouble) : torch::randn({2, 3, 8}, torch::kDouble));
  at::Tensor x_eval = torch::randn({5, 8}, torch::kDouble);

  // reference: plain DP-equivalent run (mean of the per-rank losses)
  torch::optim::SGD ref_opt(ref->parameters(), lr);
  std::vector<std::vector<double>> ref_loss(STEPS);
  for (int s = 0; s < STEPS; ++s) {
    ref_opt.zero_grad();
    at::Tensor tot;
    for (int r = 0; r < W; ++r) {
      auto l = ref->forward(data[s][r]).pow(2).mean();
      ref_loss[s].push_back(l.item<double>());
      tot = r == 0 ? l : tot + l;
    }
    (tot / W).backward();
    ref_opt.step();
  }
  at::Tensor ref_eval, ref_inf;
  at::Tensor x_inf = torch::randn({2, 3, 8}, torch::kDouble);
  {
    torch::NoGradGuard ng;
    ref->b1->fc1->weight.mul_(0.5);  // in-place on a parameter (tests write-back on the sharded side)
    ref_eval = ref->forward(x_eval);
    ref_inf = ref->forward(x_inf);
  }
  auto ref_params = ref->parameters();

  mp::SimPG pg(W);
  std::vector<std::vector<double>> loss(W);
  std::vector<at::Tensor> evals(W), infs(W);
  std::vector<std::vector<at::Tensor>> finals(W);
  std::vector<std::string> trace0;
  std::vector<std::string> mem_after_bwd(W);
  std::vector<long> gathers(W), frees(W);
  auto rank_fn = [&](int rank) {
    Net& net = nets[rank];
    mp::RankState rs;
    rs.rank = rank;
    std::vector<mp::Unit*> units = {mp::fully_shard(*net->b1, "b1", rank, &pg, rs),
                                    mp::fully_shard(*net->b2, "b2", rank, &pg, rs),
                                    mp::fully_shard(*net, "root", rank, &pg, rs)};
    std::vector<at::Tensor> shards;
    for (auto* u : units) shards.push_back(u->shard);
    torch::optim::SGD opt(shards, lr);  // the optimizer sees only the shards
    for (int s = 0; s < STEPS; ++s) {
      if (rank == 0 && s == 0) rs.trace = &trace0;
      opt.zero_grad();
      auto l = net->forward(data[s][rank]).pow(2).mean();
      if (rs.trace) rs.trace->push_back("|fwd done|");
      l.backward();
      if (rs.trace) rs.trace->push_back("|bwd done|");
      rs.trace = nullptr;
      loss[rank].push_back(l.item<double>());
      if (s == 0) {
        std::ostringstream o;
        long held = 0, grads = 0;
        for (auto& p : net->parameters()) {
          held += p.storage().nbytes();
          grads += p.grad().defined();
        }
        o << "param bytes held=" << held << ", full grads held=" << grads;
        mem_after_bwd[rank] = o.str();
      }
      opt.step();
    }
    {
      torch::NoGradGuard ng;
      net->b1->fc1->weight.mul_(0.5);  // user in-place op on a sharded param -> gather, mul_, write back to shard
      evals[rank] = net->forward(x_eval);
    }
    {
      c10::InferenceMode im;  // autograd keys excluded: linear reaches us as an undecomposed aten::matmul
      infs[rank] = net->forward(x_inf).clone();
    }
    for (auto* u : units)
      for (auto& t : mp::full_params(*u)) finals[rank].push_back(t);
    gathers[rank] = rs.gathers;
    frees[rank] = rs.frees;
  };
  std::thread t0(rank_fn, 0), t1(rank_fn, 1);
  t0.join();
  t1.join();

  std::cout << "  rank0 step0 event trace: ";
  for (auto& e : trace0) std::cout << e << " ";
  std::cout << "\n  after step-0 backward: rank0 " << mem_after_bwd[0] << "; rank1 " << mem_after_bwd[1] << "\n";
  std::cout << "  rank0 totals: gathers=" << gathers[0] << " frees=" << frees[0] << " collectives=" << pg.collectives << "\n";
  double dl = 0;
  for (int s = 0; s < STEPS; ++s)
    for (int r = 0; r < W; ++r) dl = std::max(dl, std::abs(loss[r][s] - ref_loss[s][r]));
  check("per-rank losses vs reference (3 steps)", dl);
  // finals are in unit order b1, b2, root(head); ref->parameters() order is b1.*, b2.*, head.*
  double dp = 0;
  for (int r = 0; r < W; ++r)
    for (size_t i = 0; i < ref_params.size(); ++i) dp = std::max(dp, md(finals[r][i], ref_params[i]));
  check("parameters after 3 steps + in-place mul_ (gathered from shards) vs reference", dp);
  check("no_grad eval forward, both ranks, vs reference", std::max(md(evals[0], ref_eval), md(evals[1], ref_eval)));
  check("InferenceMode 3-D forward, both ranks, vs reference", std::max(md(infs[0], ref_inf), md(infs[1], ref_inf)));
}

// -------------------------------------------------------------------- (b) tensor parallel
static void test_tp(bool comm) {
  mp::g_tp_comm = comm;
  std::cout << "=== (b) tp::parallelize: fc1 Colwise, fc2 Rowwise, 2 ranks" << (comm ? "" : "  [NEGATIVE CONTROL: comm disabled]")
            << "\n";
  const int W = 2;
  torch::manual_seed(1);
  Block ref;
  ref->to(torch::kDouble);
  std::vector<Block> blks;
  for (int r = 0; r < W; ++r) {
    blks.emplace_back();
    blks.back()->to(torch::kDouble);
    copy_params(*blks.back(), *ref);
  }
  std::vector<at::Tensor> xs = {torch::randn({4, 8}, torch::kDouble), torch::randn({2, 3, 8}, torch::kDouble)};
  mp::SimPG pg(W);
  struct Res { at::Tensor y, gx, gw1, gb1, gw2, gb2; };
  std::vector<std::vector<Res>> res(W);
  std::vector<at::Tensor> yinf(W);
  auto rank_fn = [&](int rank) {
    Block& b = blks[rank];
    mp::parallelize(b->fc1, mp::Style::Colwise, rank, &pg);
    mp::parallelize(b->fc2, mp::Style::Rowwise, rank, &pg);
    for (auto& x0 : xs) {
      b->zero_grad();
      auto x = x0.clone().requires_grad_(true);
      auto y = b->forward(x);
      y.pow(2).sum().backward();
      // clone: Module::zero_grad() in 1.13 zeroes the grad tensors in place
      res[rank].push_back({y.detach(), x.grad().clone(), b->fc1->weight.grad().clone(), b->fc1->bias.grad().clone(),
                           b->fc2->weight.grad().clone(), b->fc2->bias.grad().clone()});
    }
    c10::InferenceMode im;
    yinf[rank] = b->forward(xs[1]).clone();
  };
  std::thread t0(rank_fn, 0), t1(rank_fn, 1);
  t0.join();
  t1.join();
  for (size_t i = 0; i < xs.size(); ++i) {
    ref->zero_grad();
    auto x = xs[i].clone().requires_grad_(true);
    auto y = ref->forward(x);
    y.pow(2).sum().backward();
    double dy = 0, dx = 0, dw1 = 0, db1 = 0, dw2 = 0, db2 = 0;
    for (int r = 0; r < W; ++r) {
      auto& R = res[r][i];
      dy = std::max(dy, md(R.y, y));
      dx = std::max(dx, md(R.gx, x.grad()));
      dw1 = std::max(dw1, md(R.gw1, ref->fc1->weight.grad().narrow(0, r * 16, 16)));
      db1 = std::max(db1, md(R.gb1, ref->fc1->bias.grad().narrow(0, r * 16, 16)));
      dw2 = std::max(dw2, md(R.gw2, ref->fc2->weight.grad().narrow(1, r * 16, 16)));
      db2 = std::max(db2, md(R.gb2, ref->fc2->bias.grad()));
    }
    std::string tag = i == 0 ? "2-D " : "3-D ";
    if (i == 1 && comm) check("3-D InferenceMode forward (aten::matmul path)", std::max(md(yinf[0], y), md(yinf[1], y)));
    if (comm) {
      check(tag + "forward output (rowwise all-reduce + bias once)", dy);
      check(tag + "grad input (colwise backward all-reduce)", dx);
      check(tag + "grad fc1.weight/bias shards", std::max(dw1, db1));
      check(tag + "grad fc2.weight shard / replicated bias", std::max(dw2, db2));
    } else {
      std::cout << "  " << tag << "without comm: out maxabs=" << dy << " grad-input maxabs=" << dx << " (expected > 0)\n";
    }
  }
  mp::g_tp_comm = true;
}

// -------------------------------------------------------------------- pitfalls (each in a forked child)
static void in_child(const char* what, std::function<void()> fn) {
  std::cout.flush();
  pid_t pid = fork();
  if (pid == 0) {
    fn();
    std::cout.flush();
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  std::cout << "  [" << what << "] child " << (WIFSIGNALED(st) ? "killed by signal " + std::to_string(WTERMSIG(st))
                                                               : "exit " + std::to_string(WEXITSTATUS(st)))
            << "\n";
}
static void pitfalls() {
  std::cout << "=== pitfalls (single rank, world=1)\n";
  in_child("print a resharded param", [] {
    mp::SimPG pg(1);
    mp::RankState rs;
    torch::nn::Linear lin(2, 3);
    mp::fully_shard(*lin, "lin", 0, &pg, rs);
    std::cout << "    storage nbytes=" << lin->weight.storage().nbytes() << " data_ptr=" << lin->weight.data_ptr() << "\n";
    std::cout << lin->weight << "\n";
  });
  in_child("print a resharded kDouble param (printing needs no dtype conversion)", [] {
    mp::SimPG pg(1);
    mp::RankState rs;
    torch::nn::Linear lin(2, 3);
    lin->to(torch::kDouble);
    mp::fully_shard(*lin, "lin", 0, &pg, rs);
    std::cout << lin->weight << "\n";
  });
  in_child("print after an op touched it (gathered)", [] {
    mp::SimPG pg(1);
    mp::RankState rs;
    torch::nn::Linear lin(2, 3);
    mp::fully_shard(*lin, "lin", 0, &pg, rs);
    auto y = lin(torch::ones({1, 2}));
    std::cout << "    " << lin->weight.sum().item<float>() << " (sum via dispatched op works)\n";
  });
  in_child("Module::to(dtype) after fully_shard", [] {
    mp::SimPG pg(1);
    mp::RankState rs;
    torch::nn::Linear lin(2, 3);
    mp::fully_shard(*lin, "lin", 0, &pg, rs);
    lin->to(torch::kDouble);
    std::cout << "    key still set after to(kDouble): " << lin->weight.key_set().has(mp::kKey) << "\n";
  });
  in_child("optimizer built on module->parameters()", [] {
    mp::SimPG pg(1);
    mp::RankState rs;
    torch::nn::Linear lin(2, 3);
    auto* u = mp::fully_shard(*lin, "lin", 0, &pg, rs);
    torch::optim::SGD opt(lin->parameters(), 0.1);
    lin(torch::ones({1, 2})).sum().backward();
    std::cout << "    module weight.grad defined after backward: " << lin->weight.grad().defined()
              << " (reduce-scatter moved it to the shard); shard.grad defined: " << u->shard.grad().defined() << "\n";
    opt.step();
    std::cout << "    opt.step() on module params ran (no grads -> no-op)\n";
  });
}

static double loop_us(torch::nn::Linear& lin, const at::Tensor& x, int n) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) auto y = lin(x);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}
static void timing() {
  std::cout << "=== timing: 10k forward calls of Linear(8,32) float32, grad mode on, world=1 (steady state, no collective)\n";
  torch::manual_seed(0);
  torch::nn::Linear plain(8, 32), sharded(8, 32);
  mp::SimPG pg(1);
  mp::RankState rs;
  mp::fully_shard(*sharded, "lin", 0, &pg, rs);
  for (int dim : {2, 3}) {
    auto x = dim == 2 ? torch::randn({4, 8}) : torch::randn({2, 3, 8});
    loop_us(plain, x, 1000);
    loop_us(sharded, x, 1000);
    double best_p = 1e9, best_s = 1e9;
    for (int rep = 0; rep < 3; ++rep) {
      best_p = std::min(best_p, loop_us(plain, x, 10000));
      best_s = std::min(best_s, loop_us(sharded, x, 10000));
    }
    std::cout << "  " << dim << "-D input: plain " << best_p << " us/call, fully_shard'ed " << best_s << " us/call, overhead "
              << best_s - best_p << " us/call (intercepted ops/call: " << (dim == 2 ? 2 : 3) << ")\n";
  }
}

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  std::string sel = argc > 1 ? argv[1] : "fsdp,tp,pit,time";
  if (sel.find("fsdp") != std::string::npos) test_fsdp();
  if (sel.find("tp") != std::string::npos) {
    test_tp(true);
    test_tp(false);
  }
  if (sel.find("pit") != std::string::npos) pitfalls();
  if (sel.find("time") != std::string::npos) timing();
  std::cout << "worst checked maxabs = " << g_worst << "\n";
  return 0;
}
