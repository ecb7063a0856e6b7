// Nothing lost, nothing silently wrong, round 4 (issue 54): one job per save
// directory, input files proven the same on every rank and watched while
// training, the last step saved (also at SIGTERM), outputs that never replace
// what they did not write, and the flags every rank must share. Each case is
// a way an operator got it wrong that used to lose checkpoints or train on
// bytes nobody chose, with exit code 0.
#include <gtest/gtest.h>

#include <algorithm>

#include <string>

#include "util/files.h"
#include "shell.h"

using meshtrain::testing::contains;
using meshtrain::testing::kBin;
using meshtrain::testing::kMeshrun;
using meshtrain::testing::sh;
using meshtrain::testing::Shell;
using meshtrain::testing::TempDir;

namespace {

const std::string kTiny =
    " --model gpt --layers 1 --hidden 16 --heads 2 --seq-len 8 --global-batch 4 --eval-problems 0 --log-every 1000"
    " --comm-timeout 20 ";

std::string meshtrain_on(int ranks, const std::string& flags) {
  return kMeshrun + "--nproc-per-node " + std::to_string(ranks) + " -- " + kBin + "/meshtrain" + kTiny + flags;
}

// Two ranks; rank 1 runs in `rank1_dir` (another node's copy of the files).
std::string two_ranks_apart(const std::string& dir, const std::string& flags, const std::string& rank1_dir) {
  const std::string cmd = kBin + "/meshtrain" + kTiny + flags;
  return "cd " + dir + " && " + kMeshrun + "--nproc-per-node 2 -- bash -c 'if [ $RANK = 1 ]; then cd " + rank1_dir +
         "; fi; exec " + cmd + "'";
}

std::string read(const std::string& path) { return meshtrain::files::read_all(path); }

// Token shards of the GPL (byte tokens), ~35 KB each.
void make_shards(const std::string& prefix) {
  ASSERT_EQ(sh(kBin + "/meshtrain data --out " + prefix + " /usr/share/common-licenses/GPL-3").exit_code, 0);
}

}  // namespace

// Two jobs started together with one --save-dir both passed the "holds another
// run" check, both said "saved", and the directory kept one job's checkpoints.
TEST(OneJobPerSaveDir, TheSecondJobIsRefusedNamingTheFirst) {
  TempDir t;
  const std::string ck = t.file("ck");
  // A live job holds the lock (here flock(1) in its place): refused, --overwrite included.
  sh("mkdir -p " + ck);
  const std::string holder = "flock " + ck + "/.meshtrain-lock sh -c 'echo \"a job of the test\" > " + ck +
                             "/.meshtrain-lock; sleep 29.75'";
  sh("(" + holder + ") > /dev/null 2>&1 & for i in $(seq 200); do grep -q 'a job of the test' " + ck +
     "/.meshtrain-lock 2>/dev/null && break; sleep 0.05; done");  // the holder has the lock
  Shell r = sh(meshtrain_on(2, "--steps 4 --save-dir " + ck + " --save-every 2 --overwrite"));
  sh("pkill -f 'sleep 29.75' ; true");
  EXPECT_EQ(r.exit_code, 1) << r.output;  // meshrun's: a rank failed (with 2: a configuration error)
  EXPECT_TRUE(contains(r.output, "--save-dir " + ck + " is in use by another job (a job of the test holds " + ck +
                                     "/.meshtrain-lock)")) << r.output;
  EXPECT_TRUE(contains(r.output, "--overwrite does not take a directory from a running job")) << r.output;
  EXPECT_FALSE(meshtrain::files::exists(ck + "/latest")) << r.output;

  // The lock file a dead job left (not held) is taken over.
  r = sh(meshtrain_on(2, "--steps 4 --save-dir " + ck + " --save-every 2"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read(ck + "/latest"), "step-00000004\n");
  EXPECT_TRUE(contains(read(ck + "/.meshtrain-lock"), "a job started ")) << read(ck + "/.meshtrain-lock");

  // Two jobs at once: the second is refused while the first trains; the
  // directory holds the first one's checkpoints only. The second starts once
  // the first has saved, and the first trains until the second is done (a
  // fixed delay, or a fixed number of steps, raced on a quiet machine: the
  // first job ended before the second looked), then stops on SIGTERM at a
  // step's end with its checkpoint.
  const std::string dir2 = t.file("ck2");
  r = sh("cd " + t.path() + " && { " +
         meshtrain_on(2, "--steps 100000 --seed 1 --save-dir " + dir2 + " --save-every 30 --keep-last 3") +
         " > a.log 2>&1 & pid=$!; for i in $(seq 1200); do grep -q 'checkpoint step 30 saved' a.log && break; "
         "sleep 0.05; done; " +
         meshtrain_on(2, "--steps 60 --seed 2 --save-dir " + dir2 + " --save-every 3 --keep-last 3") +
         "; echo rc=$?; kill -TERM $pid; wait $pid; echo first_rc=$?; }");
  const std::string a = read(t.file("a.log"));
  EXPECT_TRUE(contains(r.output, "first_rc=143")) << a;  // stopped by the SIGTERM, after a checkpoint
  EXPECT_FALSE(contains(a, "is in use by another job")) << a;
  EXPECT_TRUE(contains(r.output, "is in use by another job")) << a << "\n---\n" << r.output;
  EXPECT_TRUE(contains(r.output, "started ")) << "names the holder\n" << r.output;
  EXPECT_TRUE(contains(r.output, "rc=1\n")) << r.output;
  EXPECT_FALSE(contains(r.output, "saved")) << r.output;  // the second job wrote nothing
  const std::string latest = read(dir2 + "/latest");
  ASSERT_EQ(latest.rfind("step-", 0), 0u) << a;
  const int last = std::stoi(latest.substr(5));
  EXPECT_GE(last, 30) << a;
  EXPECT_TRUE(contains(a, "checkpoint step " + std::to_string(last) + " saved")) << a;
  // keep-last 3: the first job's three newest, nothing else.
  const std::string listed = sh("ls " + dir2).output;
  EXPECT_EQ(std::count(listed.begin(), listed.end(), '\n'), 4) << listed;
  EXPECT_TRUE(contains(listed, latest)) << listed;
}

// A run of 8 steps saving every 3 ended with `latest` at step 6; `export
// --resume` then exported older weights without a word.
TEST(LastStepSaved, ARunEndsWithTheCheckpointOfItsLastStep) {
  TempDir t;
  Shell r = sh("cd " + t.path() + " && " + meshtrain_on(2, "--steps 8 --save-dir ck --save-every 3"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read(t.file("ck/latest")), "step-00000008\n");
  EXPECT_EQ(sh("ls " + t.file("ck")).output, "latest\nstep-00000003\nstep-00000006\nstep-00000008\n");
  // --save-dir without --save-every: the end only.
  r = sh("cd " + t.path() + " && " + meshtrain_on(1, "--steps 5 --save-dir ck1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(sh("ls " + t.file("ck1")).output, "latest\nstep-00000005\n");
}

// SIGTERM (a preemption, or meshrun stopped) used to kill the ranks in the
// middle of a step: everything since the last --save-every was lost.
TEST(LastStepSaved, SigtermStopsAtAStepEndWithACheckpointThatResumes) {
  TempDir t;
  const std::string train = meshtrain_on(2, "--steps 100000 --save-dir " + t.file("ck") + " --log-every 1");
  Shell r = sh("cd " + t.path() + " && { " + train + " > run.log 2>&1 & pid=$!; "
               "for i in $(seq 200); do grep -q 'step   20/' run.log && break; sleep 0.1; done; "
               "kill -TERM $pid; wait $pid; echo rc=$?; cat run.log; }");
  EXPECT_TRUE(contains(r.output, "rc=143")) << r.output;
  const std::string latest = read(t.file("ck/latest"));
  ASSERT_EQ(latest.rfind("step-", 0), 0u) << r.output;
  const int saved = std::stoi(latest.substr(5));
  EXPECT_GE(saved, 20) << r.output;
  EXPECT_TRUE(contains(r.output, "stopped after step " + std::to_string(saved) + ": SIGTERM; checkpoint step " +
                                     std::to_string(saved) + " saved in " + t.file("ck") + ": continue with --resume"))
      << r.output;
  r = sh(meshtrain_on(2, "--steps " + std::to_string(saved + 2) + " --save-dir " + t.file("ck") + " --resume"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from checkpoint step " + std::to_string(saved))) << r.output;
}

// The same --data name holding other bytes on one node, differing only
// between the blocks the start-up fingerprint samples (a 122,839-byte run in
// an 8 MB shard trained silently), is found by the whole-content hash before
// anything is saved.
TEST(InputsProven, DataThatDiffersBetweenSampledBlocksIsFoundBeforeTheFirstCheckpoint) {
  TempDir t;
  sh("mkdir -p " + t.file("a") + " " + t.file("b"));
  // 1 MiB of byte tokens; rank 1's copy differs in 2,000 bytes at 105,000, between two sampled 4 KiB blocks
  // (they start every 16,579 bytes or so).
  sh("cd " + t.path() + " && for i in $(seq 30); do cat /usr/share/common-licenses/GPL-3; done | head -c 1048576 > a/text.txt"
     " && cp a/text.txt b/text.txt && printf '%2000s' | tr ' ' x | dd of=b/text.txt bs=1 seek=105000 conv=notrunc "
     "status=none");
  const Shell r = sh(two_ranks_apart(t.file("a"), "--steps 50 --data text.txt --save-dir " + t.file("ck") +
                                                      " --save-every 1", t.file("b")));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--data: rank 1 read other bytes than rank 0 under the same name (rank 0: --data "
                                 "text.txt: 1048576 bytes, xxh3 ")) << r.output;
  EXPECT_FALSE(meshtrain::files::exists(t.file("ck/latest"))) << r.output;
}

// A shard rewritten in place while training (same size, valid ids: `dd
// conv=notrunc`) trained on the new bytes to the end, rc 0.
TEST(InputsWatched, AShardRewrittenInPlaceStopsTheJobBeforeItsNextCheckpoint) {
  TempDir t;
  make_shards(t.file("s"));
  const std::string shard = t.file("s_000000.bin");
  const std::string train = meshtrain_on(2, "--steps 100000 --data " + shard + " --save-dir " + t.file("ck") +
                                                " --save-every 1");
  // Valid byte ids (letters) over a stretch of tokens, size unchanged, once the job has saved.
  const Shell r = sh("{ (for i in $(seq 300); do [ -f " + t.file("ck/latest") + " ] && break; sleep 0.1; done; "
                     "printf 'abababababababababab' | dd of=" + shard + " bs=1 seek=2048 conv=notrunc status=none) & " +
                     train + "; }");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--data " + shard + " changed while training: rewritten in place (modified at "))
      << r.output;
  EXPECT_TRUE(contains(r.output, "stopped before saving anything trained on the new bytes")) << r.output;
}

// --deterministic-threads 2 on one rank silently broke the bitwise promise.
TEST(SameFlags, DeterministicThreadsAndEvalProblemsAreCompared) {
  TempDir t;
  for (const auto& c : {std::make_pair("--deterministic --deterministic-threads 1",
                                       "--deterministic-threads is 1 on rank 0 but 2 on rank 1"),
                        std::make_pair("--eval-problems 0", "--eval-problems is 0 on rank 0 but 5 on rank 1")}) {
    const std::string rank1 = std::string(c.first) == "--eval-problems 0" ? "--eval-problems 5" : "--deterministic-threads 2";
    const Shell r = sh("cd " + t.path() + " && " + kMeshrun + "--nproc-per-node 2 -- bash -c 'if [ $RANK = 1 ]; then "
                       "exec " + kBin + "/meshtrain" + kTiny + "--steps 2 " + c.first + " " + rank1 + "; else exec " +
                       kBin + "/meshtrain" + kTiny + "--steps 2 " + c.first + "; fi'");
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, c.second)) << r.output;
  }
}

// --metrics-out runs/x.json failed after training when runs/ did not exist.
TEST(Outputs, MissingDirectoriesOfTheOutputFilesAreMade) {
  TempDir t;
  const Shell r = sh("cd " + t.path() + " && " + meshtrain_on(2, "--steps 3 --metrics-out runs/a/x.json --plot "
                                                                  "plots/loss.svg"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(meshtrain::files::exists(t.file("runs/a/x.json"))) << r.output;
  EXPECT_TRUE(meshtrain::files::exists(t.file("runs/a/x.json.steps.jsonl"))) << r.output;
  EXPECT_TRUE(meshtrain::files::exists(t.file("plots/loss.svg"))) << r.output;
}

namespace {

const std::string kTinyGpt2 = " --model gpt2 --layers 1 --hidden 16 --heads 2 --seq-len 8 --vocab 256 --global-batch 4 "
                              "--eval-problems 0 --log-every 1000 --comm-timeout 20 ";

// A tiny GPT-2 trained one step and exported as llm.c's .bin: `dir`/m.bin.
void tiny_gpt2_bin(const std::string& dir) {
  const Shell r = sh("cd " + dir + " && " + kBin + "/meshtrain" + kTinyGpt2 + "--steps 1 --save-dir ck && " + kBin +
                     "/meshtrain export --resume ck --out m.bin");
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

// Overwrites the float32 value `index` of an llm.c checkpoint (after its 1 KiB
// header) with 4 bytes given as printf's octal escapes (sh's printf has no \x).
void poke_floats(const std::string& file, int index, const std::string& octal4) {
  sh("printf '" + octal4 + "' | dd of=" + file + " bs=1 seek=" + std::to_string(1024 + 4 * index) +
     " conv=notrunc status=none");
}

}  // namespace

// The same --init-from path with other bytes on one node trained silently
// under --tp 2: each tp rank loads its own slice, and nothing compared them.
TEST(InputsProven, InitFromWeightsThatDifferOnOneRankAreRefused) {
  TempDir t;
  sh("mkdir -p " + t.file("a") + " " + t.file("b"));
  tiny_gpt2_bin(t.file("a"));
  sh("cp " + t.file("a/m.bin") + " " + t.file("b/m.bin"));
  poke_floats(t.file("b/m.bin"), 3000, "\\000\\000\\200\\077");  // one weight of rank 1's copy is 1.0
  const Shell r = sh("cd " + t.file("a") + " && " + kMeshrun + "--nproc-per-node 2 -- bash -c 'if [ $RANK = 1 ]; then "
                     "cd " + t.file("b") + "; fi; exec " + kBin + "/meshtrain" + kTinyGpt2 + "--tp 2 --steps 20 "
                     "--init-from m.bin --save-dir " + t.file("ck") + " --save-every 1'");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--init-from: rank 1 read other bytes than rank 0 under the same name (rank 0: "
                                 "--init-from m.bin: ")) << r.output;
  EXPECT_FALSE(meshtrain::files::exists(t.file("ck/latest"))) << r.output;
}

// `export --out` replaced a user's file with a model (rc 0), wrote into
// non-empty directories, and left an empty directory after a failure.
TEST(Export, AnExistingOutputIsRefusedUnlessOverwriteAndAFailureLeavesNothing) {
  TempDir t;
  tiny_gpt2_bin(t.path());
  const std::string cd = "cd " + t.path() + " && ";
  sh(cd + "echo mine > notes.bin && mkdir full && echo mine > full/notes.txt");
  Shell r = sh(cd + kBin + "/meshtrain export --resume ck --out notes.bin");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--out notes.bin already exists; add --overwrite to replace it")) << r.output;
  EXPECT_EQ(read(t.file("notes.bin")), "mine\n");
  r = sh(cd + kBin + "/meshtrain export --resume ck --out full");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--out full already exists and is not empty")) << r.output;
  r = sh(cd + kBin + "/meshtrain export --resume ck --out notes.bin --format hf --overwrite");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--out notes.bin is a file, and --format hf writes a directory")) << r.output;
  r = sh(cd + kBin + "/meshtrain export --resume ck --out notes.bin --overwrite");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read(t.file("notes.bin")), read(t.file("m.bin")));
  // A write that fails (a file-size limit: a full disk's EFBIG) removes the directory it made.
  r = sh(cd + "ulimit -f 8 && trap '' XFSZ && " + kBin + "/meshtrain export --resume ck --out hf");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "File too large")) << r.output;
  EXPECT_FALSE(meshtrain::files::exists(t.file("hf"))) << r.output;
}

// `generate` from NaN weights printed token 0 forever (rc 0), and
// --max-new-tokens -5 was accepted.
TEST(Generate, NonFiniteWeightsAndNegativeCountsAreRefused) {
  TempDir t;
  tiny_gpt2_bin(t.path());
  const std::string cd = "cd " + t.path() + " && ";
  Shell r = sh(cd + kBin + "/meshtrain generate --init-from m.bin --prompt-ids 1,2 --max-new-tokens -5");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "--max-new-tokens -5 generates nothing; give 1 or more")) << r.output;
  r = sh(cd + kBin + "/meshtrain generate --init-from m.bin --prompt-ids 1,2 --max-new-tokens 3");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  poke_floats(t.file("m.bin"), 100, "\\000\\000\\300\\177");  // NaN
  r = sh(cd + kBin + "/meshtrain generate --init-from m.bin --prompt-ids 1,2 --max-new-tokens 3");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "llm.c checkpoint m.bin: 'embed.tok.weight' holds 1 non-finite values")) << r.output;
}
