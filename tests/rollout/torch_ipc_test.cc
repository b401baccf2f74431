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
#include <vector>

#include "absl/strings/str_cat.h"
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

// Each rank's entry equals the pickle written for that rank alone; the entries differ only in
// the reference-counter slot.
TEST(SglangFlattenedBucketPickle, EveryRanksEntryIsThePickleWrittenForItsSlot) {
  transport::BucketManifest m;
  m.nbytes = 64;
  m.tensors.push_back({"a.weight", DType::kBFloat16, {4, 4}, 0, 32});
  m.tensors.push_back({"b.weight", DType::kBFloat16, {4, 4}, 32, 32});
  absl::StatusOr<std::vector<std::string>> all = SglangFlattenedBucketPickles(m, Shared(64), 40, 3);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 3u);
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<std::string> one = SglangFlattenedBucketPickle(m, Shared(64), 40 + r);
    ASSERT_TRUE(one.ok());
    EXPECT_EQ((*all)[r], *one) << "rank " << r;
  }
  ASSERT_EQ((*all)[0].size(), (*all)[2].size());
  int differing = 0;
  for (size_t i = 0; i < (*all)[0].size(); ++i) differing += (*all)[0][i] != (*all)[2][i];
  EXPECT_EQ(differing, 1);  // 40 -> 42: one byte of the little-endian slot
  EXPECT_FALSE(SglangFlattenedBucketPickles(m, Shared(64), 0, 0).ok());
}

TEST(TorchUuid, IsTorchsStrOfTheUuid) {
  EXPECT_EQ(TorchUuid("GPU-0A1b2C3d-0000-1111-2222-333344445555"),
            "0a1b2c3d-0000-1111-2222-333344445555");
  EXPECT_EQ(TorchUuid("0a1b2c3d-0000-1111-2222-333344445555"),
            "0a1b2c3d-0000-1111-2222-333344445555");
}

// PROTO 4, then `body` as one FRAME (an 8-byte little-endian length).
std::string Framed(const std::string& body) {
  std::string out("\x80\x04\x95", 3);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((body.size() >> (8 * i)) & 0xff));
  return out + body;
}

// Frames split a long pickle at opcode boundaries near 64 KiB, as Python's pickler does; the
// frames' lengths cover the stream exactly.
TEST(PickleWriter, FramesALongPickleAtOpcodeBoundaries) {
  PickleWriter w;
  w.Mark();
  const std::string s(1000, 'x');  // BINUNICODE: 5 + 1000 bytes
  for (int i = 0; i < 200; ++i) w.Str(s);
  w.List();
  const std::string p = w.Finish();
  ASSERT_EQ(p.substr(0, 2), std::string("\x80\x04", 2));
  size_t at = 2;
  std::vector<uint64_t> lengths;
  while (at < p.size()) {
    ASSERT_EQ(p[at], '\x95') << "a FRAME at " << at;
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(p[at + 1 + i]);
    lengths.push_back(n);
    at += 9;
    // A frame starts with an opcode of this stream: MARK, BINUNICODE, or (last) LIST.
    EXPECT_TRUE(p[at] == '(' || p[at] == 'X' || p[at] == 'l') << "frame " << lengths.size();
    at += n;
  }
  EXPECT_EQ(at, p.size());
  ASSERT_EQ(lengths.size(), 4u);  // 1 + 200 * 1005 + 2 bytes in frames of 64 KiB and a bit
  for (size_t i = 0; i + 1 < lengths.size(); ++i) {
    EXPECT_GE(lengths[i], 64u << 10);
    EXPECT_LT(lengths[i], (64u << 10) + 1005);
  }
  EXPECT_EQ(p.substr(p.size() - 2), "l.");
}

// Int32Slot's offset is where its 4 bytes are in the framed pickle, in the first frame and
// after frame breaks; PatchInt32 rewrites exactly them.
TEST(PickleWriter, Int32SlotsAreFoundInTheFramedPickle) {
  PickleWriter w;
  w.Mark();
  const size_t first = w.Int32Slot(7);
  const std::string s(1000, 'x');
  for (int i = 0; i < 150; ++i) w.Str(s);
  const size_t later = w.Int32Slot(-2);
  w.Tuple();
  std::string p = w.Finish();
  ASSERT_EQ(p[first - 1], 'J');
  EXPECT_EQ(p.substr(first, 4), std::string("\x07\x00\x00\x00", 4));
  ASSERT_EQ(p[later - 1], 'J');
  EXPECT_EQ(p.substr(later, 4), std::string("\xfe\xff\xff\xff", 4));
  const std::string before = p;
  PickleWriter::PatchInt32(p, later, 0x01020304);
  EXPECT_EQ(p.substr(later, 4), std::string("\x04\x03\x02\x01", 4));
  EXPECT_EQ(p.substr(0, later), before.substr(0, later));
  EXPECT_EQ(p.substr(later + 4), before.substr(later + 4));
}

TEST(PickleWriter, WritesTheSmallestIntegerOpcodes) {
  PickleWriter w;
  w.Mark().Int(7).Int(300).Int(-1).Int(int64_t{1} << 40).Tuple();
  const std::string p = w.Finish();
  // MARK, K 7, J 300, J -1, LONG1 8 bytes, TUPLE, STOP.
  const std::string body = std::string("(K\x07J\x2c\x01\x00\x00J\xff\xff\xff\xff", 13) +
                           std::string("\x8a\x08\x00\x00\x00\x00\x00\x01\x00\x00", 10) + "t.";
  EXPECT_EQ(p, Framed(body));
}

// Python's pickler memoizes a global at its first reference and refers to it by memo after;
// so does the writer, so a receiver's find_class runs once per distinct global.
TEST(PickleWriter, MemoizesGlobalsAndKeys) {
  PickleWriter w;
  w.Mark().Global("torch", "Size").Key("k").Global("torch", "Size").Key("k").Tuple();
  EXPECT_EQ(w.memoized(), 2u);
  const std::string p = w.Finish();
  // MARK, GLOBAL, BINPUT 0, BINUNICODE "k", BINPUT 1, BINGET 0, BINGET 1, TUPLE, STOP.
  const std::string body = std::string("(ctorch\nSize\nq\x00X\x01\x00\x00\x00kq\x01", 23) +
                           std::string("h\x00h\x01t.", 6);
  EXPECT_EQ(p, Framed(body));
}

// Past 256 memo entries the writer switches to the 4-byte index opcodes.
TEST(PickleWriter, UsesLongMemoIndicesPast255) {
  PickleWriter w;
  w.Mark();
  for (int i = 0; i < 300; ++i) w.Key(absl::StrCat("k", i));
  w.Key("k299").Tuple();
  const std::string p = w.Finish();
  // ... LONG_BINPUT 299 after "k299", LONG_BINGET 299 at the end.
  EXPECT_NE(p.find(std::string("k299r\x2b\x01\x00\x00", 9)), std::string::npos);
  EXPECT_EQ(p.substr(p.size() - 7), std::string("j\x2b\x01\x00\x00t.", 7));
}

// A bucket of many tensors names each global once: the metadata of 1,000 tensors resolves
// FlattenedTensorMetadata, torch.Size and the dtype once, not 3,000 times.
TEST(SglangFlattenedBucketPickle, NamesEachGlobalOnce) {
  transport::BucketManifest m;
  m.nbytes = 1000 * 32;
  for (int i = 0; i < 1000; ++i) {
    m.tensors.push_back({absl::StrCat("layers.", i, ".weight"),
                         DType::kBFloat16,
                         {4, 4},
                         static_cast<uint64_t>(i) * 32,
                         32});
  }
  absl::StatusOr<std::string> p = SglangFlattenedBucketPickle(m, Shared(m.nbytes), 0);
  ASSERT_TRUE(p.ok()) << p.status();
  size_t count = 0;
  for (size_t at = 0; (at = p->find("FlattenedTensorMetadata", at)) != std::string::npos; ++at) {
    ++count;
  }
  EXPECT_EQ(count, 1u);
  count = 0;
  for (size_t at = 0; (at = p->find("\nSize\n", at)) != std::string::npos; ++at) ++count;
  EXPECT_EQ(count, 1u);
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
