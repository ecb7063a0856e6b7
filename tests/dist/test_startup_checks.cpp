// What every rank must share, checked at start (issue 31): checkpoint flags,
// the save directory, the data's bytes, and a resume's data order. Each case
// is a way a user or operator gets it wrong that used to train on, hang or
// destroy checkpoints.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "meshtrain/util/files.h"
#include "shell.h"

using meshtrain::testing::contains;
using meshtrain::testing::kBin;
using meshtrain::testing::kMeshrun;
using meshtrain::testing::sh;
using meshtrain::testing::Shell;
using meshtrain::testing::TempDir;

namespace {

const std::string kTiny =
    " --model gpt --layers 1 --hidden 16 --heads 2 --seq-len 8 --global-batch 4 --eval-problems 0 --log-every 100"
    " --comm-timeout 20 ";

// Two ranks in `dir`; rank 1 gets `rank1_extra` after the common flags (and
// runs in `rank1_dir` when given).
Shell two_ranks(const std::string& dir, const std::string& flags, const std::string& rank1_extra = "",
                const std::string& rank1_dir = "") {
  const std::string rank1 = (rank1_dir.empty() ? "" : "cd " + rank1_dir + " && ") + "exec " + kBin + "/meshtrain" +
                            kTiny + flags + " " + rank1_extra;
  return sh("cd " + dir + " && " + kMeshrun + "--nproc-per-node 2 -- bash -c 'if [ $RANK = 1 ]; then " + rank1 +
            "; else exec " + kBin + "/meshtrain" + kTiny + flags + "; fi'");
}

Shell one_process(const std::string& dir, const std::string& flags) {
  return sh("cd " + dir + " && " + kBin + "/meshtrain" + kTiny + flags);
}

std::string read(const std::string& path) { return meshtrain::files::read_all(path); }

}  // namespace

// --resume given to one rank only used to start the ranks at different steps,
// rewrite the good checkpoints' manifests and move `latest` back.
TEST(StartupChecks, ResumeOnOneRankIsRefusedBeforeAnythingIsWritten) {
  TempDir t;
  ASSERT_EQ(one_process(t.path(), "--steps 10 --save-dir ck --save-every 5").exit_code, 0);
  const std::string manifest = read(t.path() + "/ck/step-00000005/manifest.json"), latest = read(t.path() + "/ck/latest");
  const Shell r = two_ranks(t.path(), "--steps 20 --save-dir ck --save-every 5", "--resume");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--resume is false on rank 0 but true on rank 1")) << r.output;
  EXPECT_EQ(read(t.path() + "/ck/step-00000005/manifest.json"), manifest);
  EXPECT_EQ(read(t.path() + "/ck/latest"), latest);
  EXPECT_LT(r.seconds, 15.0) << r.output;
}

// A different --save-every, --async-save or --keep-last on one rank hung in a
// save the others never started, or was silently ignored.
TEST(StartupChecks, CheckpointFlagsThatDifferOnOneRankAreNamed) {
  TempDir t;
  const std::string flags = "--steps 10 --save-dir ck --save-every 5";
  for (const auto& c : {std::make_pair("--save-every 3", "--save-every is 5 on rank 0 but 3 on rank 1"),
                        std::make_pair("--async-save", "--async-save is false on rank 0 but true on rank 1"),
                        std::make_pair("--keep-last 1", "--keep-last is 0 on rank 0 but 1 on rank 1")}) {
    const Shell r = two_ranks(t.path(), flags, c.first);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, c.second)) << c.first << "\n" << r.output;
    EXPECT_LT(r.seconds, 15.0) << r.output;
  }
  EXPECT_FALSE(meshtrain::files::exists(t.path() + "/ck/latest"));
}

// A relative --save-dir resolved in another working directory, and a save
// directory that is not the same directory for every rank (rank 1 sees an
// empty file system of its own mounted over it: another node's local disk).
TEST(StartupChecks, ASaveDirectoryEveryRankDoesNotShareIsRefused) {
  TempDir t;
  sh("mkdir -p " + t.path() + "/elsewhere");
  Shell r = two_ranks(t.path(), "--steps 10 --save-dir ck --save-every 5", "", t.path() + "/elsewhere");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--save-dir is \"" + t.path() + "/ck\" on rank 0 but \"" + t.path() +
                                     "/elsewhere/ck\" on rank 1")) << r.output;

  if (sh("unshare --mount true").exit_code != 0) GTEST_SKIP() << "unshare --mount is not permitted here";
  const std::string save = t.path() + "/shared";
  sh("mkdir -p " + save);
  r = sh(kMeshrun + "--nproc-per-node 2 -- bash -c 'if [ $RANK = 1 ]; then exec unshare --mount sh -c \"mount -t "
         "tmpfs none " + save + " && exec " + kBin + "/meshtrain" + kTiny + "--steps 10 --save-dir " + save +
         " --save-every 5\"; else exec " + kBin + "/meshtrain" + kTiny + "--steps 10 --save-dir " + save +
         " --save-every 5; fi'");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 0 does not see the file rank(s) 1 wrote there")) << r.output;
  EXPECT_TRUE(contains(r.output, "must be one directory every node sees")) << r.output;
  EXPECT_FALSE(meshtrain::files::exists(save + "/latest"));
}

// The same --data name holding other bytes on one rank (another node's copy)
// used to train without a word: only the path was compared.
TEST(StartupChecks, TheSameDataPathWithOtherBytesIsRefused) {
  TempDir t;
  // The copies differ only after their first KiB (a file under 4 KiB used to be compared by that KiB alone).
  const std::string gpl = " /usr/share/common-licenses/GPL-3";
  sh("mkdir -p " + t.path() + "/a " + t.path() + "/b && head -c 3000" + gpl + " > " + t.path() + "/a/text.txt && " +
     "(head -c 2000" + gpl + "; head -c 3000" + gpl + " | tail -c 1000 | tr e a) > " + t.path() + "/b/text.txt");
  const Shell r = two_ranks(t.path() + "/a", "--steps 3 --data text.txt", "", t.path() + "/b");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--data: rank 1 reads other bytes than rank 0 under the same name")) << r.output;
  EXPECT_TRUE(contains(r.output, "text.txt: 3000 bytes")) << r.output;
  EXPECT_FALSE(contains(r.output, "step ")) << r.output;
}

// Without --resume a save directory holding another run was overwritten (and
// with --keep-last mixed with it); now refused, or replaced with --overwrite.
TEST(StartupChecks, ASaveDirectoryOfAnotherRunIsRefusedOrReplacedWithOverwrite) {
  TempDir t;
  ASSERT_EQ(one_process(t.path(), "--steps 20 --save-dir ck --save-every 5").exit_code, 0);
  Shell r = two_ranks(t.path(), "--steps 10 --save-dir ck --save-every 5 --keep-last 1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "--save-dir ck holds the checkpoints of another run (the newest: "
                                 "ck/step-00000020); add --resume to continue it, --overwrite to replace it"))
      << r.output;
  EXPECT_EQ(read(t.path() + "/ck/latest"), "step-00000020\n");
  r = two_ranks(t.path(), "--steps 10 --save-dir ck --save-every 5 --keep-last 1 --overwrite");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--overwrite: removed the 4 checkpoints of the previous run")) << r.output;
  EXPECT_EQ(sh("ls " + t.path() + "/ck").output, "latest\nstep-00000010\n");
}

// The position in the data is step x global batch of the seed's permutation:
// another --global-batch or --seed on resume read other samples, silently.
TEST(StartupChecks, ResumeWithAnotherGlobalBatchOrSeedIsRefused) {
  TempDir t;
  ASSERT_EQ(one_process(t.path(), "--steps 10 --save-dir ck --save-every 5").exit_code, 0);
  Shell r = one_process(t.path(), "--steps 20 --save-dir ck --save-every 5 --resume --global-batch 8");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--global-batch is 4 in the checkpoint but 8 now")) << r.output;
  r = one_process(t.path(), "--steps 20 --save-dir ck --save-every 5 --resume --seed 7");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--seed is 1234 in the checkpoint but 7 now")) << r.output;
  EXPECT_TRUE(contains(r.output, "add --allow-config-change")) << r.output;
  r = one_process(t.path(), "--steps 20 --save-dir ck --save-every 5 --resume --seed 7 --allow-config-change");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resuming from ck/step-00000010 with a changed configuration: --seed is 1234")) << r.output;
}

// A shard changed under a running job: truncated (a read past its new end was
// a bus error), or rewritten with ids past the vocabulary (under tp 2 the
// vocabulary-parallel layers masked them and the loss went on, wrong). A
// rewrite with valid ids: test_nothing_lost.cpp.
TEST(DataGuards, AShardTruncatedOrRewrittenWhileTrainingIsNamed) {
  TempDir t;
  ASSERT_EQ(sh(kBin + "/meshtrain data --out " + t.path() + "/s /usr/share/common-licenses/GPL-3 "
               "/usr/share/common-licenses/Apache-2.0").exit_code, 0);
  const std::string shard = t.path() + "/s_000000.bin";
  sh("cp " + shard + " " + t.path() + "/original.bin");
  const std::string train = kMeshrun + "--nproc-per-node 2 -- " + kBin + "/meshtrain" + kTiny +
                            "--hidden 32 --seq-len 32 --steps 1000000 --data " + shard;
  Shell r = sh("{ (sleep 3; truncate -s 5000 " + shard + ") & " + train + "; }");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--data " + shard + " changed while training: 5000 bytes now")) << r.output;
  EXPECT_FALSE(contains(r.output, "Bus error")) << r.output;

  sh("cp " + t.path() + "/original.bin " + shard);
  // 30000 ids of 60000 from the first token on, the file's size unchanged.
  r = sh("{ (sleep 3; /usr/bin/python3 -c \"f = open('" + shard + "', 'r+b'); f.seek(1024); "
         "f.write(bytes([0x60, 0xea]) * 30000)\") & " + train + " --tp 2; }");
  EXPECT_NE(r.exit_code, 0) << r.output;
  // Seen by the per-step check of the file's stamp (Note [Input files are
  // proven, then watched]), or, when the write lands between that check and
  // the next read, by the read's vocabulary check.
  EXPECT_TRUE(contains(r.output, "--data " + shard + " changed while training: rewritten in place") ||
              (contains(r.output, "--data " + shard + ": token 60000 at position") &&
               contains(r.output, "is not below the vocabulary size 256: the file changed while training")))
      << r.output;
}
