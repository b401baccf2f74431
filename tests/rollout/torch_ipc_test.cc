// The producer's side of torch's CUDA tensor sharing (core/rollout/torch_ipc.h): the reference
// counter file as a receiving torch opens it (aten/src/ATen/MapAllocator.cpp: the int32 mapping
// count at byte 0, the int64 counters from byte 64), and the shared bucket's pickle is checked
// against torch's and SGLang's own loaders by tests/python/test_colocated_wire.py.
#include "core/rollout/torch_ipc.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "core/rollout/pickle_writer.h"
#include "core/rollout/vllm_driver.h"

namespace wpub::rollout {
namespace {

constexpr size_t kBytes = TorchRefCounters::kDataOffset + TorchRefCounters::kSlots * 8;

// What a receiving torch does when it frees a storage: open the file without creating it, map
// it, add to the mapping count, decrement the slot, drop its mapping count (unlinking the file
// when the count reaches 0), unmap.
bool ReceiverRelease(const std::string& name, size_t slot) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return false;
  void* base = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return false;
  auto* count = static_cast<std::atomic<int>*>(base);
  ++*count;
  auto* counters = reinterpret_cast<std::atomic<int64_t>*>(static_cast<char*>(base) + 64);
  --counters[slot];
  if (--*count == 0) shm_unlink(name.c_str());
  munmap(base, kBytes);
  return true;
}

TEST(TorchRefCounters, LaidOutAsTorchsFileAndReleasedByReceivers) {
  absl::StatusOr<std::unique_ptr<TorchRefCounters>> c = TorchRefCounters::Create();
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string name = (*c)->name();
  EXPECT_EQ(name.rfind("/wpub_", 0), 0u) << name;
  // The file is the size torch maps, with the owner's mapping count of 1.
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(lseek(fd, 0, SEEK_END), static_cast<off_t>(kBytes));
  int32_t count = 0;
  ASSERT_EQ(pread(fd, &count, sizeof(count), 0), static_cast<ssize_t>(sizeof(count)));
  EXPECT_EQ(count, 1);
  (*c)->Set(7, 2);
  int64_t slot = 0;
  ASSERT_EQ(pread(fd, &slot, sizeof(slot), 64 + 7 * 8), static_cast<ssize_t>(sizeof(slot)));
  EXPECT_EQ(slot, 2);
  close(fd);
  // Two ranks release the bucket; the owner's count keeps the file.
  ASSERT_TRUE(ReceiverRelease(name, 7));
  EXPECT_EQ((*c)->Get(7), 1);
  ASSERT_TRUE(ReceiverRelease(name, 7));
  EXPECT_EQ((*c)->Get(7), 0);
  ASSERT_TRUE(ReceiverRelease(name, 8));  // still there
  c->reset();
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0) << "unlinked with its owner";
}

transport::SharedDeviceBytes Shared(uint64_t nbytes) {
  transport::SharedDeviceBytes s;
  s.mem_handle = std::string(64, '\x11');
  s.event_handle = std::string(64, '\x22');
  s.allocation_bytes = 1 << 20;
  s.offset_bytes = 4096;
  s.nbytes = nbytes;
  s.device = 0;
  s.device_uuid = "GPU-0A1b2C3d-0000-1111-2222-333344445555";
  s.ref_counter = "/wpub_1_x";
  s.ref_counter_offset = 10;
  return s;
}

TEST(SglangFlattenedBucketPickle, NamesTheTensorBeyondItsBucket) {
  transport::BucketManifest m;
  m.index = 3;
  m.nbytes = 64;
  m.tensors.push_back({"a.weight", DType::kBFloat16, {4, 4}, 0, 32});
  m.tensors.push_back({"b.weight", DType::kBFloat16, {4, 8}, 32, 64});
  absl::StatusOr<std::string> p = SglangFlattenedBucketPickle(m, Shared(64), 0);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("b.weight"), std::string::npos) << p.status();
  m.tensors.pop_back();
  EXPECT_TRUE(SglangFlattenedBucketPickle(m, Shared(64), 0).ok());
}

TEST(TorchUuid, IsTorchsStrOfTheUuid) {
  EXPECT_EQ(TorchUuid("GPU-0A1b2C3d-0000-1111-2222-333344445555"),
            "0a1b2c3d-0000-1111-2222-333344445555");
  EXPECT_EQ(TorchUuid("0a1b2c3d-0000-1111-2222-333344445555"),
            "0a1b2c3d-0000-1111-2222-333344445555");
}

TEST(PickleWriter, WritesTheSmallestIntegerOpcodes) {
  PickleWriter w;
  w.Mark().Int(7).Int(300).Int(-1).Int(int64_t{1} << 40).Tuple();
  const std::string p = w.Finish();
  // PROTO 3, MARK, K 7, J 300, J -1, LONG1 8 bytes, TUPLE, STOP.
  const std::string want = std::string("\x80\x03(K\x07J\x2c\x01\x00\x00J\xff\xff\xff\xff", 15) +
                           std::string("\x8a\x08\x00\x00\x00\x00\x00\x01\x00\x00", 10) + "t.";
  EXPECT_EQ(p, want);
}

}  // namespace
}  // namespace wpub::rollout

namespace wpub::rollout {
namespace {

// vLLM's IPC backend refuses unknown keys (parse_update_info's TypeError -> ValueError): the
// body carries exactly its fields, "packed" only for a release that takes it per update, and a
// bucket whose tensors are not back to back is refused naming the tensor.
TEST(VllmIpcBodies, CarryExactlyTheBackendsFields) {
  EXPECT_EQ(VllmIpcInitBody(true), R"({"init_info":{"packed":true}})");
  EXPECT_EQ(VllmIpcInitBody(false), R"({"init_info":{}})");
  transport::BucketManifest m;
  m.index = 1;
  m.nbytes = 36;
  m.tensors.push_back({"s", DType::kFloat32, {}, 0, 4});
  m.tensors.push_back({"w", DType::kBFloat16, {4, 4}, 4, 32});
  transport::SharedDeviceBytes s = Shared(36);
  s.node_device_uuids = {"GPU-00000000-0000-0000-0000-000000000001"};
  absl::StatusOr<std::string> body = VllmIpcUpdateBody(m, s, 5, /*packed_per_update=*/false);
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_NE(body->find(R"("shapes":[[1],[4,4]])"), std::string::npos) << *body;
  EXPECT_NE(body->find(R"("tensor_sizes":[4,32])"), std::string::npos) << *body;
  EXPECT_EQ(body->find("packed\""), std::string::npos) << *body;
  body = VllmIpcUpdateBody(m, s, 5, /*packed_per_update=*/true);
  ASSERT_TRUE(body.ok());
  EXPECT_NE(body->find(R"("packed":true)"), std::string::npos) << *body;
  m.tensors[1].offset = 8;  // a gap
  body = VllmIpcUpdateBody(m, s, 5, false);
  ASSERT_FALSE(body.ok());
  EXPECT_NE(body.status().message().find("tensor w"), std::string::npos) << body.status();
}

}  // namespace
}  // namespace wpub::rollout
