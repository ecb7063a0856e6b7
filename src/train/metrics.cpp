#include "meshtrain/train.h"

#include <ATen/ATen.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "meshtrain/util.h"
#include "util/svg.h"

namespace meshtrain {
namespace train {

int64_t peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

std::string state_bytes_json(const StateBytes& s) {
  return json::Object()
      .integer("parameters", s.parameters)
      .integer("gradients", s.gradients)
      .integer("optimizer", s.optimizer)
      .integer("buffers", s.buffers)
      .integer("model_state", s.model_state())
      .str();
}

std::string traffic_json(const comm::Traffic& total, int steps) {
  json::Object ops;
  for (int k = 0; k < comm::kNumOpKinds; ++k) {
    const auto& t = total.ops[k];
    if (t.calls == 0 && t.bytes_sent == 0 && t.bytes_received == 0) continue;
    json::Object row;
    row.num("calls", static_cast<double>(t.calls) / steps)
        .num("bytes_sent", static_cast<double>(t.bytes_sent) / steps)
        .num("bytes_received", static_cast<double>(t.bytes_received) / steps);
    if (t.inter_host_sent != 0 || t.inter_host_received != 0) {
      row.num("inter_host_sent", static_cast<double>(t.inter_host_sent) / steps)
          .num("inter_host_received", static_cast<double>(t.inter_host_received) / steps);
    }
    ops.raw(comm::op_name(static_cast<comm::OpKind>(k)), row.str());
  }
  const auto p = total.payload_total();
  ops.raw("total", json::Object()
                       .num("calls", static_cast<double>(p.calls) / steps)
                       .num("bytes_sent", static_cast<double>(p.bytes_sent) / steps)
                       .num("bytes_received", static_cast<double>(p.bytes_received) / steps)
                       .str());
  ops.raw("inter_host", json::Object()
                            .num("bytes_sent", static_cast<double>(p.inter_host_sent) / steps)
                            .num("bytes_received", static_cast<double>(p.inter_host_received) / steps)
                            .str());
  return ops.str();
}

std::string ascii_plot(const std::vector<double>& values, int width, int height) {
  if (values.empty()) return "";
  const double lo = *std::min_element(values.begin(), values.end());
  const double hi = *std::max_element(values.begin(), values.end());
  const double span = hi > lo ? hi - lo : 1.0;
  std::vector<std::string> grid(height, std::string(width, ' '));
  const int n = static_cast<int>(values.size());
  for (int x = 0; x < width; ++x) {
    // The mean of the values that fall in this column.
    const int a = x * n / width, b = std::max(a + 1, (x + 1) * n / width);
    if (a >= n) break;
    double sum = 0;
    for (int i = a; i < b && i < n; ++i) sum += values[i];
    const double v = sum / (std::min(b, n) - a);
    const int y = static_cast<int>(std::lround((hi - v) / span * (height - 1)));
    grid[std::clamp(y, 0, height - 1)][x] = '*';
  }
  std::string out;
  char label[32];
  for (int y = 0; y < height; ++y) {
    const double v = hi - span * y / (height - 1);
    std::snprintf(label, sizeof label, "%8.4f |", v);
    out += label + grid[y] + "\n";
  }
  out += std::string(9, ' ') + "+" + std::string(width, '-') + "\n";
  std::snprintf(label, sizeof label, "step 1");
  out += std::string(10, ' ') + label + std::string(std::max(1, width - 12), ' ') + std::to_string(n) + "\n";
  return out;
}

void write_svg_plot(const std::string& path, const std::vector<double>& values, const std::string& title) {
  const int W = 640, H = 360, L = 60, R = 20, T = 40, B = 40;
  const double lo = values.empty() ? 0 : *std::min_element(values.begin(), values.end());
  const double hi = values.empty() ? 1 : *std::max_element(values.begin(), values.end());
  const double span = hi > lo ? hi - lo : 1.0;
  auto px = [&](size_t i) { return L + (values.size() > 1 ? (W - L - R) * static_cast<double>(i) / (values.size() - 1) : 0); };
  auto py = [&](double v) { return T + (H - T - B) * (hi - v) / span; };
  svg::Document doc(W, H, 12);
  doc.text(W / 2, 22, title, "middle", 14).line(L, H - B, W - R, H - B, "black").line(L, T, L, H - B, "black");
  for (int k = 0; k <= 4; ++k) {
    const double v = lo + span * k / 4;
    char label[32];
    std::snprintf(label, sizeof label, "%.3f", v);
    doc.text(L - 6, py(v) + 4, label, "end");
  }
  doc.text((L + W - R) / 2, H - 10, "step (1 to " + std::to_string(values.size()) + ")", "middle");
  std::vector<std::pair<double, double>> points;
  for (size_t i = 0; i < values.size(); ++i) points.emplace_back(px(i), py(values[i]));
  doc.polyline(points, {"none", "#1f77b4", 2});
  doc.write(path, "the loss plot");
}

// The busiest expert's routes over the mean, the largest over the layers: 1
// is perfect balance, `experts / top_k` every token on the same experts.
double router_imbalance(const at::Tensor& load) {
  const at::Tensor routes = load.narrow(1, 0, load.size(1) - 1);
  const at::Tensor per_layer = std::get<0>(routes.max(1)) / routes.mean(1).clamp_min(1e-12);
  return per_layer.max().item<double>();
}

std::string router_load_json(const at::Tensor& load) {
  std::vector<std::string> layers;
  for (int64_t l = 0; l < load.size(0); ++l) {
    std::vector<std::string> counts;
    for (int64_t e = 0; e + 1 < load.size(1); ++e) counts.push_back(std::to_string(load[l][e].item<int64_t>()));
    layers.push_back(json::array(counts));
  }
  return json::array(layers);
}

int64_t routes_dropped(const at::Tensor& load) { return load.select(1, -1).sum().item<int64_t>(); }

}  // namespace train
}  // namespace meshtrain
