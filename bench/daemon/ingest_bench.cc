// gRPC ingestion throughput of wpubd vs inline chunk size, over loopback: a real wpubd process
// (the built binary) and the C++ Publisher client stream a publication of BF16 passthrough
// tensors (recipe bf16, no receivers, so quantization and transfer stay out of the way) with
// chunks of 64 KiB .. 4 MiB; the same publication through POSIX shared memory (no payload on
// the stream) is the baseline of the same run. Figures: the daemon's ingest phase (header to
// commit) and the client's send time, in MB/s (1 MB = 1e6 bytes), best of --iterations.
//
//   ingest_bench [--total_mib=512] [--tensor_mib=16] [--iterations=3]
//                [--chunk_kib=64,256,1024,4096] [--json=out.json]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/client/child_process.h"
#include "server/client/publisher_client.h"

ABSL_FLAG(int32_t, total_mib, 512, "Publication size in MiB.");
ABSL_FLAG(int32_t, tensor_mib, 16, "Size of each BF16 tensor in MiB.");
ABSL_FLAG(int32_t, iterations, 3, "Publications per configuration; the best is reported.");
ABSL_FLAG(std::vector<std::string>, chunk_kib,
          std::vector<std::string>({"64", "256", "1024", "4096"}), "Inline chunk sizes in KiB.");
ABSL_FLAG(std::string, json, "", "Also write the rows as JSON here.");
ABSL_FLAG(std::string, wpubd, WPUBD_PATH, "The wpubd binary.");

namespace {

namespace pb = ::wpub::v1;
using wpub::client::PayloadSource;

struct Row {
  std::string config;
  uint64_t chunk_bytes = 0;
  uint64_t bytes = 0;
  uint64_t messages = 0;
  double ingest_s = 0;  // daemon: header .. commit received (best)
  double send_s = 0;    // client: first message .. commit written (best)
  double wall_s = 0;    // daemon: whole publication (best)
};

int Main() {
  const int64_t tensor_bytes = int64_t{absl::GetFlag(FLAGS_tensor_mib)} << 20;
  const int64_t n = (int64_t{absl::GetFlag(FLAGS_total_mib)} << 20) / tensor_bytes;
  // Dense MLP weights: passed through on every recipe.
  std::vector<wpub::synthetic::ConversionBatch> batches;
  for (int64_t i = 0; i < n; ++i) {
    wpub::synthetic::ConversionBatch b;
    b.megatron_name = absl::StrCat("decoder.layers.", i, ".mlp.linear_fc2.weight");
    b.tensors.push_back({absl::StrCat("model.layers.", i, ".mlp.down_proj.weight"),
                         wpub::DType::kBFloat16,
                         {tensor_bytes / 2 / 2048, 2048}});
    batches.push_back(std::move(b));
  }
  // The client copies from one prepared buffer: data generation stays out of the figures.
  std::vector<uint8_t> pattern(static_cast<size_t>(tensor_bytes));
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 131 + 7);
  wpub::client::TensorFiller fill = [&](const wpub::TensorDesc&, absl::Span<uint8_t> out) {
    std::memcpy(out.data(), pattern.data(), out.size());
    return absl::OkStatus();
  };

  char tmpl[] = "/tmp/wpub-ingest-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::string dir = tmpl;
  auto daemon = wpub::client::ChildProcess::Spawn(
      {absl::GetFlag(FLAGS_wpubd),
       {"--listen=127.0.0.1:0", "--metrics_listen=", "--ready_file=" + dir + "/ready.json",
        "--log_level=warn", "--bucket_bytes=1073741824"},
       dir + "/wpubd.log"});
  if (!daemon.ok()) {
    std::fprintf(stderr, "%s\n", daemon.status().ToString().c_str());
    return 1;
  }
  auto ports =
      wpub::client::WaitForReadyFile(dir + "/ready.json", daemon->get(), absl::Seconds(30));
  if (!ports.ok()) {
    std::fprintf(stderr, "%s\n", ports.status().ToString().c_str());
    return 1;
  }
  wpub::client::ClientOptions client_options;
  client_options.target = absl::StrCat("127.0.0.1:", ports->grpc_port);
  auto client = wpub::client::PublisherClient::Create(client_options);
  if (!client.ok()) return 1;

  std::vector<std::pair<std::string, wpub::client::StreamOptions>> configs;
  for (const std::string& kib : absl::GetFlag(FLAGS_chunk_kib)) {
    wpub::client::StreamOptions o;
    o.chunk_bytes = std::stoull(kib) << 10;
    configs.emplace_back(absl::StrCat("inline ", kib, " KiB"), o);
  }
  wpub::client::StreamOptions shm;
  shm.source = PayloadSource::kShm;
  configs.emplace_back("shm (baseline)", shm);

  uint64_t version = 1;
  std::vector<Row> rows;
  for (const auto& [name, stream] : configs) {
    Row row;
    row.config = name;
    row.chunk_bytes = stream.source == PayloadSource::kInline ? stream.chunk_bytes : 0;
    for (int it = 0; it < absl::GetFlag(FLAGS_iterations); ++it) {
      pb::PublicationHeader header;
      header.set_version(version++);
      header.set_model_id("ingest-bench");
      header.set_recipe("bf16");
      wpub::client::PublishTimings t;
      auto report = (*client)->Publish(header, batches, fill, stream, &t);
      if (!report.ok() || report->status() != pb::PUBLICATION_STATUS_COMMITTED) {
        std::fprintf(
            stderr, "%s: %s\n", name.c_str(),
            report.ok() ? report->error_message().c_str() : report.status().ToString().c_str());
        return 1;
      }
      row.bytes = report->bytes_in();
      row.messages = t.messages;
      if (it == 0 || report->phases().ingest() < row.ingest_s)
        row.ingest_s = report->phases().ingest();
      if (it == 0 || t.send_seconds < row.send_s) row.send_s = t.send_seconds;
      if (it == 0 || report->wall_seconds() < row.wall_s) row.wall_s = report->wall_seconds();
    }
    rows.push_back(row);
  }
  daemon->get()->Stop();

  std::printf(
      "gRPC ingestion over loopback: %lld x %s BF16 tensors (%s MiB), best of %d\n\n",
      static_cast<long long>(n), absl::StrCat(absl::GetFlag(FLAGS_tensor_mib), " MiB").c_str(),
      absl::StrCat(absl::GetFlag(FLAGS_total_mib)).c_str(), absl::GetFlag(FLAGS_iterations));
  std::printf(
      "| payload | messages | daemon ingest s | ingest MB/s | client send MB/s | publication wall "
      "s | vs shm |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  const double shm_rate = rows.back().bytes / rows.back().ingest_s / 1e6;
  std::string json = "[";
  for (const Row& r : rows) {
    const double rate = r.bytes / r.ingest_s / 1e6;
    const double send_rate = r.bytes / r.send_s / 1e6;
    std::printf("| %s | %llu | %.3f | %.0f | %.0f | %.3f | %.2fx |\n", r.config.c_str(),
                static_cast<unsigned long long>(r.messages), r.ingest_s, rate, send_rate, r.wall_s,
                rate / shm_rate);
    absl::StrAppend(&json, json.size() > 1 ? "," : "",
                    absl::StrFormat("{\"config\":\"%s\",\"chunk_bytes\":%d,\"bytes\":%d,"
                                    "\"messages\":%d,\"ingest_s\":%.6f,\"ingest_MBps\":%.1f,"
                                    "\"send_s\":%.6f,\"wall_s\":%.6f}",
                                    r.config, r.chunk_bytes, r.bytes, r.messages, r.ingest_s, rate,
                                    r.send_s, r.wall_s));
  }
  json += "]\n";
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << json;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Main();
}
