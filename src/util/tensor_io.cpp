#include "util/tensor_io.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize.h>  // torch::pickle_save / pickle_load

#include <cstring>
#include <fstream>
#include <sstream>

#include "meshtrain/util.h"

namespace meshtrain {

// Integers and tensor bytes are written as they lie in memory; the format is little endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "meshtrain's tensor files are little endian");

namespace {

constexpr char kMagic[8] = {'M', 'T', 'T', 'E', 'N', 'S', '0', '1'};

void put_i64(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), 8); }

int64_t get_i64(const std::string& in, size_t& pos, const std::string& what) {
  MESHTRAIN_CHECK(pos + 8 <= in.size(), what, ": truncated (ends inside a header)");
  int64_t v;
  std::memcpy(&v, in.data() + pos, 8);
  pos += 8;
  return v;
}

}  // namespace

std::string serialize_tensors(const std::map<std::string, at::Tensor>& tensors) {
  size_t total = 16;
  for (const auto& kv : tensors) total += 8 * (5 + kv.second.dim()) + kv.first.size() + kv.second.nbytes();
  std::string out;
  out.reserve(total);  // one allocation: a checkpoint shard is copied once, not once per doubling
  out.append(kMagic, 8);
  put_i64(out, static_cast<int64_t>(tensors.size()));
  for (const auto& kv : tensors) {
    const at::Tensor t = kv.second.detach().cpu().contiguous();
    put_i64(out, static_cast<int64_t>(kv.first.size()));
    out += kv.first;
    put_i64(out, static_cast<int64_t>(t.scalar_type()));
    put_i64(out, t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) put_i64(out, t.size(d));
    put_i64(out, static_cast<int64_t>(t.nbytes()));
    out.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  return out;
}

std::map<std::string, at::Tensor> deserialize_tensors(const std::string& in, const std::string& what) {
  MESHTRAIN_CHECK(in.size() >= 16 && std::memcmp(in.data(), kMagic, 8) == 0, what,
                  ": not a meshtrain tensor file (bad magic)");
  size_t pos = 8;
  const int64_t count = get_i64(in, pos, what);
  std::map<std::string, at::Tensor> out;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t name_len = get_i64(in, pos, what);
    MESHTRAIN_CHECK(name_len >= 0 && pos + name_len <= in.size(), what, ": truncated (ends inside a name)");
    const std::string name = in.substr(pos, name_len);
    pos += name_len;
    const auto dtype = static_cast<at::ScalarType>(get_i64(in, pos, what));
    const int64_t ndim = get_i64(in, pos, what);
    MESHTRAIN_CHECK(ndim >= 0 && ndim <= 16, what, ": corrupt header for tensor '", name, "'");
    std::vector<int64_t> shape;
    for (int64_t d = 0; d < ndim; ++d) shape.push_back(get_i64(in, pos, what));
    const int64_t nbytes = get_i64(in, pos, what);
    MESHTRAIN_CHECK(nbytes >= 0 && pos + nbytes <= in.size(), what, ": truncated (tensor '", name, "' is cut short)");
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
    MESHTRAIN_CHECK(static_cast<int64_t>(t.nbytes()) == nbytes, what, ": corrupt size for tensor '", name, "'");
    std::memcpy(t.data_ptr(), in.data() + pos, nbytes);
    pos += nbytes;
    out[name] = t;
  }
  return out;
}

std::string torch_save_bytes(const std::map<std::string, at::Tensor>& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& kv : tensors) {
    at::Tensor t = kv.second.detach().cpu().contiguous();
    // The archive holds whole storages: a view of part of one is copied out, not saved with the rest.
    if (t.storage_offset() != 0 || t.storage().nbytes() != t.nbytes()) t = t.clone();
    dict.insert(kv.first, t);
  }
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
  return std::string(bytes.begin(), bytes.end());
}

std::map<std::string, at::Tensor> torch_load_bytes(const std::string& bytes, const std::string& what) {
  c10::IValue value;
  try {
    value = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  } catch (const c10::Error& e) {
    throw ConfigError(str_cat(what, ": not a torch.save archive (", e.what_without_backtrace(), ")"));
  }
  MESHTRAIN_CHECK(value.isGenericDict(), what, ": a torch.save archive, but not of a dict of tensors");
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : value.toGenericDict()) {
    MESHTRAIN_CHECK(kv.key().isString() && kv.value().isTensor(), what, ": a torch.save archive, but not of a dict of tensors");
    out[kv.key().toStringRef()] = kv.value().toTensor();
  }
  return out;
}

void save_tensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors) {
  std::ofstream out(path, std::ios::binary);
  MESHTRAIN_CHECK(out.good(), "cannot write ", path);
  const std::string bytes = serialize_tensors(tensors);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  MESHTRAIN_CHECK(out.good(), "writing ", path, " failed");
}

std::map<std::string, at::Tensor> load_tensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MESHTRAIN_CHECK(in.good(), "cannot open ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return deserialize_tensors(ss.str(), path);
}

}  // namespace meshtrain
