// Engine HTTP requests (engine_http.h).
#include "core/rollout/engine_http.h"

#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "core/common/json_bounds.h"

namespace wpub::rollout {

std::vector<std::optional<std::string>> GetAll(const std::vector<EngineSpec>& engines,
                                               const std::string& path, absl::Duration timeout) {
  std::vector<std::optional<std::string>> bodies(engines.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < engines.size(); ++i) {
    threads.emplace_back([&, i] {
      httplib::Client c(engines[i].url);
      const int64_t us = absl::ToInt64Microseconds(timeout);
      c.set_connection_timeout(us / 1000000, us % 1000000);
      c.set_read_timeout(us / 1000000, us % 1000000);
      httplib::Result r = c.Get(path);
      if (r && r->status >= 200 && r->status < 300) bodies[i] = std::move(r->body);
    });
  }
  for (auto& t : threads) t.join();
  return bodies;
}

}  // namespace wpub::rollout
