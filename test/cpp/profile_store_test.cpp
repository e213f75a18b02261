// The record file under real conditions: reloads, a corrupt or foreign file, other processes
// writing the same file at the same time.
#include <gtest/gtest.h>

#include <filesystem>

#include <sys/wait.h>
#include <unistd.h>

#include "profile/record_json.h"
#include "profile/record_store.h"
#include "profile_test_util.h"

namespace terra::profile {
namespace {

using testing::h200;
using testing::resnet_call;
using testing::ScratchDir;
using testing::slurp;
using testing::spit;

Entry entry_for(int64_t channels, int64_t batch = 32) {
  KeyedCall kc = make_key(resnet_call(batch, channels), Pass::forward);
  return *make_entry(kc.key, kc.batch, {testing::config(1, 0.5, 4096, {{2, 1}}), testing::config(0, 1.5, 0)});
}

bool has_warning(const Diagnostics& ds, const std::string& fragment) {
  for (const Diagnostic& d : ds)
    if (d.level == Diagnostic::Level::warning && d.message.find(fragment) != std::string::npos) return true;
  return false;
}

TEST(ProfileStore, SavesAndReloads) {
  ScratchDir dir;
  std::string path = dir.file("record.json");
  {
    RecordStore store(path, h200());
    EXPECT_TRUE(store.load().empty());  // no file yet: nothing to say
    store.put(entry_for(64));
    store.put(entry_for(128));
    EXPECT_EQ(store.unsaved(), 2u);
    Diagnostics ds = store.save();
    EXPECT_FALSE(has_warning(ds, "")) << ds.front().message;
    EXPECT_EQ(store.unsaved(), 0u);
  }
  RecordStore again(path, h200());
  again.load();
  ASSERT_NE(again.find(entry_for(64).key), nullptr);
  EXPECT_EQ(*again.find(entry_for(128).key), entry_for(128));
  EXPECT_EQ(again.find(entry_for(256).key), nullptr);
  EXPECT_FALSE(std::filesystem::exists(path + ".bak"));
}

TEST(ProfileStore, SameContentSameBytes) {
  ScratchDir dir;
  RecordStore a(dir.file("a.json"), h200());
  a.put(entry_for(64));
  a.put(entry_for(128));
  a.save();
  RecordStore b(dir.file("b.json"), h200());
  b.put(entry_for(128));
  b.save();
  b.put(entry_for(64));
  b.save();
  EXPECT_EQ(slurp(dir.file("a.json")), slurp(dir.file("b.json")));
}

TEST(ProfileStore, CorruptFileIsReportedIgnoredAndKeptAside) {
  ScratchDir dir;
  std::string path = dir.file("record.json");
  spit(path, "{\"format\": \"terra_torch.conv_profile_record\", \"entries\": [tru");
  RecordStore store(path, h200());
  Diagnostics ds = store.load();
  EXPECT_TRUE(has_warning(ds, "is corrupt")) << (ds.empty() ? "" : ds.front().message);
  EXPECT_TRUE(store.entries().empty());

  store.put(entry_for(64));
  ds = store.save();
  EXPECT_TRUE(has_warning(ds, "moved to " + path + ".bak"));
  EXPECT_EQ(slurp(path + ".bak").substr(0, 10), "{\"format\":");
  RecordStore reread(path, h200());
  EXPECT_FALSE(has_warning(reread.load(), ""));
  EXPECT_EQ(reread.entries().size(), 1u);
}

TEST(ProfileStore, EntriesOfAnotherDeviceAreIgnoredWithAWarning) {
  ScratchDir dir;
  std::string path = dir.file("record.json");
  RecordHeader a100 = h200();
  a100.device_name = "NVIDIA A100-SXM4-80GB";
  a100.compute_capability = "8.0";
  RecordStore theirs(path, a100);
  theirs.put(entry_for(64));
  theirs.save();

  RecordStore ours(path, h200());
  Diagnostics ds = ours.load();
  EXPECT_TRUE(has_warning(ds, "belongs to another device")) << (ds.empty() ? "" : ds.front().message);
  EXPECT_TRUE(has_warning(ds, "A100"));
  EXPECT_EQ(ours.find(entry_for(64).key), nullptr);

  // A different cuDNN release is another device too: its algorithms and timings differ.
  RecordHeader newer_cudnn = h200();
  newer_cudnn.cudnn_version += 100;
  RecordStore upgraded(dir.file("cudnn.json"), newer_cudnn);
  upgraded.put(entry_for(64));
  upgraded.save();
  RecordStore after_upgrade(dir.file("cudnn.json"), h200());
  EXPECT_TRUE(has_warning(after_upgrade.load(), "cuDNN"));
  EXPECT_TRUE(after_upgrade.entries().empty());

  // Torch and CUDA versions are informational only.
  RecordHeader other_torch = h200();
  other_torch.torch_version = "2.13.0";
  other_torch.cuda_version = 12080;
  RecordStore old_torch(dir.file("torch.json"), other_torch);
  old_torch.put(entry_for(64));
  old_torch.save();
  RecordStore new_torch(dir.file("torch.json"), h200());
  EXPECT_FALSE(has_warning(new_torch.load(), ""));
  EXPECT_NE(new_torch.find(entry_for(64).key), nullptr);
}

TEST(ProfileStore, OtherFormatVersionIsIgnored) {
  ScratchDir dir;
  std::string path = dir.file("record.json");
  RecordHeader future = h200();
  future.format_version = 7;
  spit(path, encode(Record{future, {entry_for(64)}}));
  RecordStore store(path, h200());
  Diagnostics ds = store.load();
  EXPECT_TRUE(has_warning(ds, "incompatible"));
  EXPECT_TRUE(store.entries().empty());
}

TEST(ProfileStore, SaveMergesWhatAnotherProcessWroteMeanwhile) {
  ScratchDir dir;
  std::string path = dir.file("record.json");
  RecordStore first(path, h200());
  RecordStore second(path, h200());
  first.load();
  second.load();
  first.put(entry_for(64));
  second.put(entry_for(128));
  first.save();
  EXPECT_TRUE(second.changed_on_disk());
  second.save();  // must not drop first's entry
  EXPECT_FALSE(second.changed_on_disk());
  EXPECT_NE(second.find(entry_for(64).key), nullptr) << "merged entries become visible in memory";

  RecordStore reader(path, h200());
  reader.load();
  EXPECT_EQ(reader.entries().size(), 2u);
}

TEST(ProfileStore, UnwritableLocationWarnsOnceAndKeepsMemory) {
  ScratchDir dir;
  RecordStore store(dir.file("missing-dir/record.json"), h200());
  store.put(entry_for(64));
  EXPECT_TRUE(has_warning(store.save(), "cannot save"));
  EXPECT_EQ(store.unsaved(), 1u);
  EXPECT_TRUE(store.save().empty()) << "the second failure is not repeated";
  EXPECT_NE(store.find(entry_for(64).key), nullptr);
}

// Two processes write the same file concurrently, many times; each save must land whole and
// neither process's entries may be lost.
TEST(ProfileStore, ConcurrentWriterProcessesNeverCorruptAndBothSurvive) {
  ScratchDir dir;
  std::string path = dir.file("record.json");
  constexpr int kPerProcess = 40;
  pid_t children[2];
  for (int p = 0; p < 2; ++p) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      RecordStore store(path, h200());
      store.load();
      bool ok = true;
      for (int i = 0; i < kPerProcess; ++i) {
        store.put(entry_for(8 + 2 * i + p));  // disjoint channel counts per process
        for (const Diagnostic& d : store.save()) ok = ok && d.level != Diagnostic::Level::warning;
        // A reader without the lock must always see a whole, usable file.
        Decoded d = decode(slurp(path));
        ok = ok && d.status == DecodeStatus::ok && d.problems.empty();
      }
      ::_exit(ok ? 0 : 1);
    }
    children[p] = pid;
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "a writer saw a warning or a partial file";
  }
  RecordStore reader(path, h200());
  EXPECT_FALSE(has_warning(reader.load(), ""));
  EXPECT_EQ(reader.entries().size(), 2u * kPerProcess);
  for (int c = 8; c < 8 + 2 * kPerProcess; ++c) EXPECT_NE(reader.find(entry_for(c).key), nullptr) << c;
  for (const auto& f : std::filesystem::directory_iterator(std::filesystem::path(path).parent_path()))
    EXPECT_EQ(f.path().string().find(".tmp."), std::string::npos) << "temporary left behind: " << f.path();
}

}  // namespace
}  // namespace terra::profile
