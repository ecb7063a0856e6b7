// safetensors reading (mapped, validated) and writing (streamed, atomic).
#include "io/safetensors.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "io/file_io.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace io {

namespace {

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
// safetensors' names for the dtypes that have a torch equivalent.
const DtypeName kDtypes[] = {{"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf},
                             {"F64", at::kDouble}, {"I64", at::kLong},     {"I32", at::kInt},
                             {"I16", at::kShort},  {"I8", at::kChar},      {"U8", at::kByte},
                             {"BOOL", at::kBool}};

std::string supported_dtypes() {
  std::string out;
  for (const DtypeName& d : kDtypes) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

std::string dtype_name(at::ScalarType type, const std::string& path, const std::string& tensor) {
  for (const DtypeName& d : kDtypes)
    if (d.type == type) return d.name;
  throw ConfigError(str_cat("safetensors file ", path, ": tensor '", tensor, "' has dtype ", type,
                            ", which safetensors cannot hold here; convert it to one of ", supported_dtypes()));
}

// One tensor as the header describes it; offsets relative to the data's start.
struct Entry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0;
  int64_t end = 0;
};

// An integer >= 0 from the header, or an error naming the tensor and field.
int64_t count_of(const json::Value& v, const std::string& where, const char* field) {
  MESHTRAIN_CHECK(v.type == json::Value::Type::kNumber && v.is_integer && v.integer >= 0, where, ": ", field,
                  " holds a value that is not an integer >= 0");
  return v.integer;
}

// Bytes of `shape` x `dtype`, or -1 when the product overflows.
int64_t bytes_of(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return -1;
  return n;
}

Entry entry_of(const std::string& name, const json::Value& v, const std::string& path) {
  const std::string where = str_cat("safetensors file ", path, ": tensor '", name, "'");
  MESHTRAIN_CHECK(v.type == json::Value::Type::kObject && v.has("dtype") && v.has("shape") && v.has("data_offsets"),
                  where, ": its header entry is not an object with dtype, shape and data_offsets");
  Entry e;
  e.name = name;
  const json::Value& dtype = v["dtype"];
  const auto known = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeName& d) {
    return dtype.type == json::Value::Type::kString && dtype.string == d.name;
  });
  MESHTRAIN_CHECK(known != std::end(kDtypes), where, ": unknown dtype ",
                  dtype.type == json::Value::Type::kString ? dtype.string : "(not a string)", "; meshtrain reads ",
                  supported_dtypes());
  e.dtype = known->type;
  const json::Value& shape = v["shape"];
  MESHTRAIN_CHECK(shape.type == json::Value::Type::kArray, where, ": shape is not an array");
  for (const json::Value& d : shape.items) e.shape.push_back(count_of(d, where, "shape"));
  const json::Value& offsets = v["data_offsets"];
  MESHTRAIN_CHECK(offsets.type == json::Value::Type::kArray && offsets.size() == 2, where,
                  ": data_offsets is not a pair [begin, end]");
  e.begin = count_of(offsets[0], where, "data_offsets");
  e.end = count_of(offsets[1], where, "data_offsets");
  MESHTRAIN_CHECK(e.begin <= e.end, where, ": data_offsets [", e.begin, ", ", e.end, "] end before they begin");
  const int64_t bytes = bytes_of(e.shape, e.dtype);
  MESHTRAIN_CHECK(bytes == e.end - e.begin, where, ": data_offsets [", e.begin, ", ", e.end, "] span ",
                  e.end - e.begin, " bytes but dtype ", known->name, " x shape ", at::IntArrayRef(e.shape),
                  " needs ", bytes, " (the header is damaged)");
  return e;
}

// The header's length N from the first 8 bytes, checked against the file.
int64_t header_length(const detail::MappedFile& f) {
  MESHTRAIN_CHECK(f.size() >= 8, "safetensors file ", f.path(), ": ", f.size(),
                  " bytes, shorter than the 8-byte header length (truncated, or not a safetensors file)");
  uint64_t n = 0;
  std::memcpy(&n, f.data(), 8);
  MESHTRAIN_CHECK(n <= static_cast<uint64_t>(f.size() - 8), "safetensors file ", f.path(), ": header length ", n,
                  " reaches beyond the file's ", f.size(), " bytes (truncated, or not a safetensors file)");
  return static_cast<int64_t>(n);
}

json::Value parse_header(const detail::MappedFile& f, int64_t n) {
  json::Value header;
  try {
    header = json::parse(std::string(reinterpret_cast<const char*>(f.data()) + 8, static_cast<size_t>(n)));
  } catch (const ConfigError& e) {
    throw ConfigError(str_cat("safetensors file ", f.path(), ": the ", n, "-byte header is not valid JSON (",
                              e.what(), ")"));
  }
  MESHTRAIN_CHECK(header.type == json::Value::Type::kObject, "safetensors file ", f.path(),
                  ": the header is not a JSON object");
  return header;
}

// Every tensor inside the data and no two overlapping (zero-size ones may sit anywhere in range).
void check_offsets(std::vector<Entry> entries, int64_t data_bytes, const std::string& path) {
  for (const Entry& e : entries) {
    MESHTRAIN_CHECK(e.end <= data_bytes, "safetensors file ", path, ": tensor '", e.name, "' data_offsets [", e.begin,
                    ", ", e.end, "] reach beyond the ", data_bytes, " bytes of data the file holds (truncated?)");
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  for (size_t i = 1; i < entries.size(); ++i) {
    const Entry& prev = entries[i - 1];
    const Entry& e = entries[i];
    MESHTRAIN_CHECK(e.begin >= prev.end, "safetensors file ", path, ": tensor '", e.name, "' data_offsets [", e.begin,
                    ", ", e.end, "] overlap tensor '", prev.name, "' [", prev.begin, ", ", prev.end,
                    "] (the header is damaged)");
  }
}

}  // namespace

std::map<std::string, at::Tensor> load_safetensors(const std::string& path) {
  const auto file = detail::MappedFile::open(path);
  const int64_t n = header_length(*file);
  const json::Value header = parse_header(*file, n);
  std::vector<Entry> entries;
  for (const auto& field : header.fields) {
    if (field.first != "__metadata__") entries.push_back(entry_of(field.first, field.second, path));
  }
  const int64_t data_start = 8 + n;
  check_offsets(entries, file->size() - data_start, path);
  std::map<std::string, at::Tensor> out;
  for (const Entry& e : entries) out[e.name] = detail::tensor_at(file, data_start + e.begin, e.shape, e.dtype);
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors) {
  json::Object header;
  header.raw("__metadata__", json::Object().str("format", "pt").str());
  std::vector<at::Tensor> data;
  int64_t offset = 0;
  for (const auto& named : tensors) {
    MESHTRAIN_CHECK(named.first != "__metadata__", "safetensors file ", path,
                    ": a tensor cannot be called __metadata__ (the format reserves the name)");
    MESHTRAIN_CHECK(named.second.defined(), "safetensors file ", path, ": tensor '", named.first, "' is undefined");
    const at::Tensor t = named.second.cpu().contiguous();
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    std::vector<std::string> shape;
    for (int64_t d : t.sizes()) shape.push_back(std::to_string(d));
    header.raw(named.first, json::Object()
                                .str("dtype", dtype_name(t.scalar_type(), path, named.first))
                                .raw("shape", json::array(shape))
                                .raw("data_offsets", json::array({std::to_string(offset), std::to_string(offset + bytes)}))
                                .str());
    data.push_back(t);
    offset += bytes;
  }
  std::string text = header.str();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data, and so every tensor, 8-byte aligned
  const uint64_t n = text.size();
  detail::AtomicFile out(path);
  out.write(&n, 8);
  out.write(text);
  for (const at::Tensor& t : data) out.write(t);
  out.commit();
}

at::Tensor to_float32(const at::Tensor& t, const std::string& what) {
  if (t.scalar_type() == at::kFloat) return t;
  MESHTRAIN_CHECK(c10::isFloatingType(t.scalar_type()), what, " has dtype ", t.scalar_type(),
                  ", not a floating-point type: it cannot be a weight");
  return t.to(at::kFloat);
}

}  // namespace io
}  // namespace meshtrain
