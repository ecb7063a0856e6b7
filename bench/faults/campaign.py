#!/usr/bin/python3
"""Fault-injection campaign: faults injected into 4-rank training jobs, many trials each.

    bench/faults/run.sh            (TRIALS=50; the table goes into docs/BENCHMARKS.md)

Each trial starts `meshrun --nproc-per-node 4 -- meshtrain` (a tiny GPT, dp 2 x pp 2 or
dp 2 x tp 2, alternating), injects one fault at a random moment, and records:
  detection  seconds from the fault to meshrun's first line naming a failure
  named      whether meshrun's summary and every survivor's error name the faulty rank
  orphans    processes of the job alive once meshrun has exited (must be 0)
  leftovers  /dev/shm segments and checkpoint temporary files left behind
  resumed    (restart trials) whether the losses after the restart equal the uninterrupted run's
Faults:
  kill-rank     SIGKILL of a random rank (forward, backward, a collective: wherever it is)
  kill-in-save  SIGKILL of a random rank while checkpoints are being written (--save-every 1)
  stop-rank     SIGSTOP of a random rank (a stuck rank; --comm-timeout 3)
  kill-meshrun  SIGKILL of meshrun itself (every rank must go)
  kill-store    two meshrun nodes of 2 ranks on loopback; SIGKILL of node 0, which hosts the store
  restart       SIGKILL of a random rank under --max-restarts 1 --resume (--save-every 2)
  disk-full     checkpoints every step into a small tmpfs (2-6 MB) until it is full: the save fails
                on every rank with a clear error, `latest` names an intact checkpoint, no .tmp left
  elastic       two meshrun nodes under --nnodes 1:2; node 1 killed, node 0 goes on alone, node 1 comes
                back and the job grows back (trial_elastic says what is measured)
  desync-flag   one random rank started with another checkpoint, data or communication setting than the
                others (DESYNC: --resume, --save-every, --save-dir, a relative --save-dir from another
                directory, MESHTRAIN_BACKEND, the rendezvous token...), resuming a saved run: refused before
                any write, naming the flag or variable; the saved run left as it was
  cut, cut-in, cut-out, frozen-host, slow-link: across two test hosts (bench/faults/partitions.py)
  stranger-frames  a process without the token sends node 0's store a decline, a wrong MAC, a request or a huge
                frame while it waits for node 1 (issue 54, item 5): logged and said, the job trains on
                (trial_stranger_frames says what is measured)
  flag-mismatch two meshrun nodes started with another --nproc-per-node, --nnodes (also MIN:MAX), --max-restarts
                or token presence (issue 54, item 6): every node refuses within seconds naming the flag and both
                values (trial_flag_mismatch)
  changed-data  the data one rank reads differs from the others' under the same name (another copy,
                truncated, a block or a token rewritten), or the shard every rank reads is truncated or
                overwritten with out-of-vocabulary ids while the job trains: refused, naming the file;
                every checkpoint saved before still whole (trial_changed_data says what is measured)
  shared-save-dir  a second job started 0-1.5 s after a first with the same --save-dir: one of them refused,
                naming the holder; the other's checkpoints all there and whole (trial_shared_save_dir)
  rewritten-in-place  the shard every rank reads rewritten in place with valid ids, the same size, while the
                job trains and saves every step: stopped naming the file, no checkpoint from the new bytes
                (trial_rewritten_in_place)
A trial that hangs (no exit within 60 s) is reported as such: it is a bug.
"""
import json, os, random, re, shutil, signal, socket, statistics, struct, subprocess, sys, tempfile, threading, time

BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "bin")
GPT = ["--model", "gpt", "--layers", "4", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq-len", "16",
       "--global-batch", "8", "--lr", "1e-2", "--eval-problems", "0", "--log-every", "1"]
LAYOUTS = [["--dp", "2", "--pp", "2"], ["--dp", "2", "--tp", "2"]]
HANG = 60
RESTART_STEPS = 400
ELASTIC_STEPS = 120
ELASTIC_GPT = GPT + ["--lr", "2e-3", "--steps", str(ELASTIC_STEPS)]  # the last --lr wins


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A meshrun process whose output lines are collected with their arrival times."""

    def __init__(self, args, env=None, cwd=None):
        self.start = time.time()
        self.lines = []
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=cwd, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait(self, timeout=HANG):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return False
        self.reader.join(timeout=5)
        return True

    def first_line(self, pattern, after=0.0):
        for t, line in self.lines:
            if t >= after and re.search(pattern, line):
                return t, line
        return None, None

    def text(self):
        return "\n".join(line for _, line in self.lines)


def environ_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None


def job_processes(port):
    """Processes whose environment says they belong to the job on `port`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            env = environ_of(int(name))
            if env and env.get(b"MASTER_PORT") == str(port).encode() and b"RANK" in env:
                out.append((int(name), int(env[b"RANK"])))
    return out


def wait_for_ranks(port, count, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        ranks = job_processes(port)
        if len(ranks) >= count:
            return ranks
        time.sleep(0.05)
    return job_processes(port)


def shm_segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("meshtrain-")}


def temp_files(directory):
    found = []
    for root, _, files in os.walk(directory):
        found += [f for f in files if f.endswith(".tmp")]
    return found


def meshrun(port, layout, extra):
    args = [os.path.join(BIN, "meshrun"), "--nproc-per-node", "4", "--master-port", str(port), "--grace-seconds", "1"]
    return args + ["--", os.path.join(BIN, "meshtrain")] + GPT + layout + extra


def survivors_name(job, rank, dead_pids_ranks):
    """Every rank that printed an error names the faulty rank; meshrun's summary too."""
    ok = True
    for _, line in job.lines:
        m = re.match(r"\[rank(\d+)\]: meshtrain: (communication failed|.*)", line)
        if m and "communication failed" in line and int(m.group(1)) != rank:
            ok = ok and (f"global rank {rank}" in line or f"rank {rank} " in line)
    summary = [line for _, line in job.lines if line.startswith("meshrun: failed:")]
    ok = ok and bool(summary) and f"rank {rank} " in summary[-1]
    return ok


def trial_kill(kind, layout, shm_before, workdir):
    port = free_port()
    extra = ["--steps", "100000"] + (["--comm-timeout", "3"] if kind == "stop-rank" else [])
    if kind == "kill-in-save":
        extra += ["--save-dir", os.path.join(workdir, "ckpt"), "--save-every", "1"]
    job = Job(meshrun(port, layout, extra))
    ranks = wait_for_ranks(port, 4)
    time.sleep(random.uniform(1.0, 3.0))
    pid, rank = random.choice(ranks)
    sig = signal.SIGSTOP if kind == "stop-rank" else signal.SIGKILL
    t_fault = time.time()
    os.kill(pid, sig)
    finished = job.wait()
    t_detect, _ = job.first_line(r"meshrun: .*(failed|stopped making progress|died)", after=t_fault)
    orphans = len(job_processes(port))
    for p, _ in job_processes(port):
        os.kill(p, signal.SIGKILL)
    leftovers = len(shm_segments() - shm_before) + len(temp_files(workdir))
    named = survivors_name(job, rank, ranks)
    return dict(hang=not finished, detection=(t_detect - t_fault) if t_detect else None, named=named,
                orphans=orphans, leftovers=leftovers, rank=rank,
                said=None if named else [line for _, line in job.lines if "loss" not in line][-12:])


def trial_kill_meshrun(layout, shm_before, workdir):
    port = free_port()
    job = Job(meshrun(port, layout, ["--steps", "100000"]))
    wait_for_ranks(port, 4)
    time.sleep(random.uniform(1.0, 3.0))
    t_fault = time.time()
    os.kill(job.proc.pid, signal.SIGKILL)
    job.wait()
    deadline = time.time() + 5
    while job_processes(port) and time.time() < deadline:
        time.sleep(0.02)
    gone = time.time() - t_fault
    orphans = len(job_processes(port))
    for p, _ in job_processes(port):
        os.kill(p, signal.SIGKILL)
    time.sleep(0.2)
    return dict(hang=False, detection=gone, named=True, orphans=orphans,
                leftovers=len(shm_segments() - shm_before))


def trial_kill_store(layout, shm_before, workdir):
    port = free_port()
    token = os.path.join(workdir, "token")
    with open(token, "w") as f:
        f.write("0123456789abcdef0123456789abcdef\n")
    common = [os.path.join(BIN, "meshrun"), "--nnodes", "2", "--nproc-per-node", "2", "--master-port", str(port),
              "--grace-seconds", "1", "--rdzv-token-file", token]
    cmd = ["--", os.path.join(BIN, "meshtrain")] + GPT + layout + ["--steps", "100000"]
    node1 = Job(common + ["--node-rank", "1"] + cmd)
    node0 = Job(common + ["--node-rank", "0"] + cmd)
    wait_for_ranks(port, 4)
    time.sleep(random.uniform(1.0, 3.0))
    t_fault = time.time()
    os.killpg(node0.proc.pid, signal.SIGKILL)  # the whole node: meshrun and its ranks
    node0.wait()
    finished = node1.wait()
    t_detect, _ = node1.first_line(r"meshrun: .*(failed|lost)", after=t_fault)
    said = [line for _, line in node1.lines if line.startswith("meshrun: ") or "communication failed" in line]
    survivors = [line for line in said if "communication failed" in line]
    named = (any(line.startswith("meshrun: ") and "rendezvous store" in line for line in said) and
             all("rendezvous store" in line or "global rank 0" in line or "global rank 1" in line
                 for line in survivors))
    orphans = len(job_processes(port))
    for p, _ in job_processes(port):
        os.kill(p, signal.SIGKILL)
    return dict(hang=not finished, detection=(t_detect - t_fault) if t_detect else None, named=named,
                orphans=orphans, leftovers=len(shm_segments() - shm_before))


def trial_disk_full(layout, shm_before, workdir):
    disk = os.path.join(workdir, "disk")
    os.makedirs(disk)
    size = random.randint(2, 6)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs", disk]).returncode != 0:
        raise SystemExit("disk-full needs to mount a tmpfs (root)")
    try:
        port = free_port()
        job = Job(meshrun(port, layout, ["--steps", "100000", "--save-dir", disk, "--save-every", "1"]))
        finished = job.wait()  # the disk fills after a few saves: no moment of fault to time from
        _, line = job.first_line(r"No space left|failed on rank")
        latest_ok = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..", "tools",
                                    "checkpoint_to_torch.py"), disk, "--list"], capture_output=True).returncode == 0
        orphans = len(job_processes(port))
        leftovers = len(temp_files(disk)) + len(shm_segments() - shm_before)
        return dict(hang=not finished, detection=None,
                    named=bool(line) and latest_ok and job.proc.returncode != 0, orphans=orphans,
                    leftovers=leftovers, said=None if line else [l for _, l in job.lines][-8:])
    finally:
        subprocess.run(["umount", disk])


def losses(path):
    with open(path) as f:
        return json.load(f)["losses"]


def trial_restart(layout, shm_before, workdir, reference):
    port = free_port()
    ckpt = os.path.join(workdir, "ckpt")
    metrics = os.path.join(workdir, "m.json")
    extra = ["--steps", str(RESTART_STEPS), "--save-dir", ckpt, "--save-every", "2", "--resume",
             "--metrics-out", metrics]
    args = meshrun(port, layout, extra)
    args[1:1] = ["--max-restarts", "1"]
    job = Job(args)
    ranks = wait_for_ranks(port, 4)
    time.sleep(random.uniform(0.5, 1.5))
    pid, rank = random.choice(ranks)
    t_fault = time.time()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # the run ended first: no fault injected
        job.wait()
        return None
    finished = job.wait(timeout=120)
    t_detect, _ = job.first_line(r"meshrun: .*failed", after=t_fault)
    restarted = "restarting the whole group" in job.text()
    equal = False
    if finished and job.proc.returncode == 0 and os.path.exists(metrics):
        m = json.load(open(metrics))
        first = m["checkpoint"]["resumed_from_step"]
        equal = restarted and m["losses"] == reference[first:first + len(m["losses"])]
        if not equal:
            print("restart: resumed from step", first, "restarted", restarted, "first losses",
                  m["losses"][:3], "reference", reference[first:first + 3], flush=True)
    orphans = len(job_processes(port))
    return dict(hang=not finished, detection=(t_detect - t_fault) if t_detect else None,
                named=f"rank {rank} " in job.text(), orphans=orphans,
                leftovers=len(shm_segments() - shm_before) + len(temp_files(ckpt)), resumed=equal)


def progress_losses(text):
    """step -> loss from the progress lines ("step   5/400 | loss   3.8348 | ..."), the last line of each step."""
    out = {}
    for m in re.finditer(r"\bstep\s+(\d+)/\d+ \| loss\s+([-\d.]+)", text):
        out[int(m.group(1))] = float(m.group(2))
    return out


def trial_elastic(layout, shm_before, workdir, reference):
    """Two meshrun nodes of 2 ranks under --nnodes 1:2; node 1 (meshrun and ranks) is killed at a random moment,
    node 0 continues alone on the planner's layout from the last checkpoint, node 1 is started again and the
    job grows back at the next checkpoint. Detection: the fault to node 0's round without node 1 (training
    goes on). Resumed equal: every step's loss (the last round's from its metrics, relative 1e-4; earlier rounds'
    from the progress lines, 4 decimals, within 2e-4) equals the uninterrupted one-process run's, and the job
    ended on both nodes. The layouts differ (4 ranks, 2, 4): equal up to float reassociation, which at --lr 2e-3
    stays below 2e-5 relative over these steps between uninterrupted layouts (at the other faults' 1e-2 the
    tiny GPT's loss spikes amplify it to 25% after 80 steps, whatever the layouts)."""
    port = free_port()
    ckpt, metrics = os.path.join(workdir, "ckpt"), os.path.join(workdir, "m.json")
    env = dict(os.environ, MESHTRAIN_RDZV_TOKEN="0123456789abcdef0123456789abcdef")
    def node(rank):
        return Job([os.path.join(BIN, "meshrun"), "--nnodes", "1:2", "--nproc-per-node", "2", "--master-port", str(port),
                    "--grace-seconds", "1", "--rdzv-last-call", "5", "--rdzv-timeout", "60", "--max-restarts", "1",
                    "--node-rank", str(rank), "--", os.path.join(BIN, "meshtrain")] + ELASTIC_GPT + layout +
                   ["--save-dir", ckpt, "--save-every", "2", "--resume", "--metrics-out", metrics], env=env)
    node1, node0 = node(1), node(0)
    wait_for_ranks(port, 4)
    time.sleep(random.uniform(0.2, 1.5))
    if node1.proc.poll() is not None:  # the run ended first: no fault injected
        node0.wait()
        return None
    t_fault = time.time()
    os.killpg(node1.proc.pid, signal.SIGKILL)
    node1.wait()
    deadline = time.time() + HANG
    while not node0.first_line(r"meshrun: round 1:")[0] and node0.proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    t_alone, alone_line = node0.first_line(r"meshrun: round 1:")
    back = node(1)
    finished = node0.wait(timeout=120) and back.wait(timeout=30)
    text = node0.text()
    grew = "(node 1 joined)" in text
    equal = False
    if finished and node0.proc.returncode == 0 and os.path.exists(metrics) and grew:
        m = json.load(open(metrics))
        first = m["first_step"]
        last_round = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(m["losses"], reference[first:]))
        printed = progress_losses(text)
        earlier = all(abs(printed[s] - reference[s - 1]) <= 2e-4 for s in printed)
        equal = last_round and earlier and len(printed) == ELASTIC_STEPS
        if not equal:
            print("elastic: first step", first, "last round equal", last_round, "printed equal", earlier,
                  "printed steps", len(printed), flush=True)
    orphans = len(job_processes(port))
    return dict(hang=not finished, detection=(t_alone - t_fault) if t_alone else None,
                named=bool(alone_line) and "(without node 1)" in alone_line, orphans=orphans,
                leftovers=len(shm_segments() - shm_before) + len(temp_files(ckpt)), resumed=equal,
                said=None if equal else [line for _, line in node0.lines if line.startswith("meshrun")][-8:])


# One rank differs from the others (wrapped by TARGET_WRAPPER): (name, what the target gets, what the refusal
# must name: a flag, found in check_same_config's sentence, or a variable; what the others get instead of the
# default). "env:" sets a variable, "unset:" removes one,
# "cd:" starts the target in another directory; anything else is extra flags (the last value of a flag wins).
DESYNC = [
    ("--resume on one rank", "--resume", "--resume", "no-resume"),
    ("--save-every", "--save-every 3", "--save-every", None),
    ("--async-save", "--async-save", "--async-save", None),
    ("--keep-last", "--keep-last 1", "--keep-last", None),
    ("--save-dir", "--save-dir {workdir}/other", "--save-dir", None),
    ("relative --save-dir, other cwd", "cd:{workdir}/elsewhere", "--save-dir", "relative"),
    ("--resume-fallback", "--resume-fallback", "--resume-fallback", None),
    ("--allow-config-change", "--allow-config-change", "--allow-config-change", None),
    ("--global-batch", "--global-batch 16", "--global-batch", None),
    ("--seed", "--seed 7", "--seed", None),
    ("--lr", "--lr 2e-2", "--lr", None),
    ("MESHTRAIN_BACKEND", "env:MESHTRAIN_BACKEND=gloo", "MESHTRAIN_BACKEND", None),
    ("another token", "env:MESHTRAIN_RDZV_TOKEN=fedcba9876543210fedcba9876543210", "MESHTRAIN_RDZV_TOKEN", None),
    ("no token", "unset:MESHTRAIN_RDZV_TOKEN", "MESHTRAIN_RDZV_TOKEN", None),
]

TARGET_WRAPPER = """#!/bin/sh
# Runs the command as given, except on rank $TARGET_RANK: TARGET_CD, TARGET_ENV, TARGET_UNSET, TARGET_EXTRA.
if [ "$RANK" = "$TARGET_RANK" ]; then
  [ -n "$TARGET_CD" ] && cd "$TARGET_CD"
  [ -n "$TARGET_ENV" ] && export "$TARGET_ENV"
  [ -n "$TARGET_UNSET" ] && unset "$TARGET_UNSET"
  exec "$@" $TARGET_EXTRA
fi
exec "$@"
"""


def file_hashes(directory, skip=("latest",)):
    """relative path -> SHA-256 of every file under `directory` (what a refused run must leave as it was)."""
    import hashlib
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(root, f)
            if os.path.relpath(path, directory) not in skip:
                out[os.path.relpath(path, directory)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def lost_checkpoint_files(before, ckpt):
    """Files of the checkpoints saved before the trial now missing or changed, plus 1 when `latest` no longer
    names a checkpoint that loads whole (tools/checkpoint_to_torch.py --list)."""
    after = file_hashes(ckpt)
    lost = sum(1 for path, digest in before.items() if after.get(path) != digest)
    loads = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..", "tools",
                            "checkpoint_to_torch.py"), ckpt, "--list"], capture_output=True).returncode == 0
    return lost + (0 if loads else 1)


def target_env(target, spec, workdir):
    env = dict(os.environ, TARGET_RANK=str(target))
    spec = spec.format(workdir=workdir)
    if spec.startswith("env:"):
        env["TARGET_ENV"] = spec[4:]
    elif spec.startswith("unset:"):
        env["TARGET_UNSET"] = spec[6:]
    elif spec.startswith("cd:"):
        env["TARGET_CD"] = spec[3:]
        os.makedirs(spec[3:], exist_ok=True)
    else:
        env["TARGET_EXTRA"] = spec
    return env


def saved_run(template, layout, extra, cwd):
    """The checkpoints of a 10-step run (made once per layout and data, copied into each trial)."""
    if not os.path.exists(template):
        subprocess.run([os.path.join(BIN, "meshrun"), "--nproc-per-node", "4", "--master-port", "0", "--quiet", "--",
                        os.path.join(BIN, "meshtrain")] + GPT + layout + extra +
                       ["--steps", "10", "--save-dir", template, "--save-every", "5"],
                       check=True, capture_output=True, cwd=cwd)
    return template


def wrapped_meshrun(port, layout, extra, workdir):
    wrapper = os.path.join(workdir, "wrap.sh")
    with open(wrapper, "w") as f:
        f.write(TARGET_WRAPPER)
    os.chmod(wrapper, 0o755)
    args = meshrun(port, layout, extra)
    at = args.index("--") + 1
    return args[:at] + [wrapper] + args[at:]


def refusal_result(job, finished, expected, t0, lost, shm_before, port):
    t_end, _ = job.first_line(r"meshrun: .*failed")
    text = job.text()
    named = job.proc.returncode not in (0, None) and re.search(expected, text) is not None
    orphans = len(job_processes(port))
    for p, _ in job_processes(port):
        os.kill(p, signal.SIGKILL)
    return dict(hang=not finished, detection=(t_end - t0) if t_end else None, named=named, orphans=orphans,
                leftovers=len(shm_segments() - shm_before), lost=lost,
                said=None if named else [line for _, line in job.lines if "loss" not in line][-6:])


def trial_desync(i, layout, shm_before, workdir, template):
    """One rank of four gets DESYNC[i]; the others resume the saved run (--resume --save-every 5). Named: the job
    failed and its output names the flag or variable; lost: files of the saved checkpoints changed or missing."""
    name, spec, expected, base = DESYNC[(i // 2) % len(DESYNC)]  # each variant on both layouts in turn
    if expected.startswith("--"):  # check_same_config's sentence: "--save-every is 5 on rank 0 but 3 on rank 2"
        expected = re.escape(expected) + r" is .* on rank \d+ but "
    ckpt = os.path.join(workdir, "ckpt")
    shutil.copytree(template, ckpt)
    before = file_hashes(ckpt)
    save_dir = "ckpt" if base == "relative" else ckpt
    extra = ["--steps", "30", "--save-dir", save_dir, "--save-every", "5"] + ([] if base == "no-resume" else ["--resume"])
    port = free_port()
    t0 = time.time()
    job = Job(wrapped_meshrun(port, layout, extra, workdir), env=target_env(random.randrange(4), spec, workdir),
              cwd=workdir)
    finished = job.wait()
    r = refusal_result(job, finished, expected, t0, lost_checkpoint_files(before, ckpt), shm_before, port)
    r["variant"] = name
    return r


CHANGED_DATA = ["another copy", "truncated copy", "a block rewritten", "one token changed",
                "truncated while training", "out-of-vocabulary ids written while training"]


def token_text(seed, words=5000):
    rnd = random.Random(seed)
    vocab = ["the", "rank", "mesh", "train", "a", "of", "pipeline", "tensor", "shard", "step", "loss", "data"]
    return " ".join(rnd.choice(vocab) for _ in range(words)) + "\n"


def make_shards(directory, text):
    os.makedirs(directory, exist_ok=True)
    source = os.path.join(directory, "text.txt")
    with open(source, "w") as f:
        f.write(text)
    subprocess.run([os.path.join(BIN, "meshtrain"), "data", "--out", os.path.join(directory, "d"), source],
                   check=True, capture_output=True)
    os.remove(source)
    return os.path.join(directory, "d_000000.bin")


def damage(path, how, rnd):
    """Changes the shard at `path` in place: how = CHANGED_DATA's kinds (uint16 tokens after a 1 KiB header)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how.startswith("truncated"):
            f.truncate(rnd.randrange(1024, size - 2, 2))
        elif how == "a block rewritten":
            f.seek(rnd.randrange(1024, size - 4096, 2))
            f.write(bytes(rnd.randrange(256) & 0x3f if k % 2 == 0 else 0 for k in range(4096)))
        elif how == "one token changed":
            at = rnd.randrange(1024, size, 2)
            f.seek(at)
            old = int.from_bytes(f.read(2), "little")
            f.seek(at)
            f.write(((old + 1) % 256).to_bytes(2, "little"))
        elif how.startswith("out-of-vocabulary"):
            f.seek(rnd.randrange(1024, size - 512, 2))
            f.write((60000).to_bytes(2, "little") * 256)


def trial_changed_data(i, layout, shm_before, workdir, templates):
    """CHANGED_DATA[i]. Before the start: one random rank runs in another directory whose d_000000.bin (the same
    relative --data) is another copy (a second text of the same length), truncated, or has a 4 KiB block or one
    token rewritten. While training: the shard every rank maps is truncated, or 512 bytes of it are overwritten
    with token 60000, 1-2 s into the run (--steps 100000: every window is read again each epoch). Named: the job
    failed and its output names d_000000.bin; lost: the saved checkpoints (resumed with --resume --save-every 5)
    changed, or `latest` no longer loads."""
    how = CHANGED_DATA[(i // 2) % len(CHANGED_DATA)]  # each kind on both layouts in turn
    rnd = random.Random(i)
    shared = os.path.join(workdir, "shared")
    shard = make_shards(shared, token_text(1))
    data_args = ["--vocab", "256", "--data", "d_*.bin"]
    template = saved_run(templates + "-" + "-".join(layout), layout, data_args, shared)
    ckpt = os.path.join(workdir, "ckpt")
    shutil.copytree(template, ckpt)
    before = file_hashes(ckpt)
    during = how.endswith("while training")
    env = dict(os.environ)
    if not during:
        copy = os.path.join(workdir, "elsewhere")
        os.makedirs(copy)
        theirs = make_shards(copy, token_text(2)) if how == "another copy" else shutil.copy(shard, copy + "/")
        if how != "another copy":
            damage(theirs, how, rnd)
        env = target_env(rnd.randrange(4), "cd:" + copy, workdir)
    port = free_port()
    extra = data_args + ["--steps", "100000" if during else "30", "--save-dir", ckpt, "--save-every", "5", "--resume"]
    t0 = time.time()
    job = Job(wrapped_meshrun(port, layout, extra, workdir), env=env, cwd=shared)
    if during:
        wait_for_ranks(port, 4)
        time.sleep(rnd.uniform(1.0, 2.0))
        t0 = time.time()
        damage(shard, how, rnd)
    finished = job.wait()
    r = refusal_result(job, finished, r"d_000000\.bin", t0, lost_checkpoint_files(before, ckpt), shm_before, port)
    r["variant"] = how
    return r


def checkpoint_steps(ckpt):
    return sorted(int(d[5:]) for d in os.listdir(ckpt) if d.startswith("step-")
                  and os.path.exists(os.path.join(ckpt, d, "manifest.json"))) if os.path.isdir(ckpt) else []


def trial_shared_save_dir(i, layout, shm_before, workdir):
    """Job A (--seed 1) and, 0-1.5 s later, job B (--seed 2), both 4 ranks with --save-dir D --save-every 5
    --keep-last 3 --steps 60. Named: exactly one job failed, its output naming the other as the holder ("is in
    use by another job (a job started ... by pid P"). Time: from the later start to the refused job's failure
    line. Lost: the winner's last three checkpoints not all in D (55, 60 and the one before), plus one when
    `latest` no longer loads whole, plus one per checkpoint in D written by the refused job (its seed in the
    manifest)."""
    rnd = random.Random(i)
    ckpt = os.path.join(workdir, "ckpt")
    extra = ["--steps", "60", "--save-dir", ckpt, "--save-every", "5", "--keep-last", "3"]
    ports = [free_port(), free_port()]
    a = Job(meshrun(ports[0], layout, extra + ["--seed", "1"]), cwd=workdir)
    time.sleep(rnd.uniform(0.0, 1.5))
    t0 = time.time()
    b = Job(meshrun(ports[1], layout, extra + ["--seed", "2"]), cwd=workdir)
    finished = a.wait() and b.wait()
    failed = [j for j in (a, b) if j.proc.returncode != 0]
    refused = failed[0] if len(failed) == 1 else None
    named = refused is not None and re.search(r"is in use by another job \(a job started .* by pid \d+",
                                               refused.text()) is not None
    winner_seed = None if refused is None else (2 if refused is a else 1)
    steps = checkpoint_steps(ckpt)
    lost = 0 if steps[-3:] == [50, 55, 60] else 1
    for s in steps:
        seed = json.load(open(os.path.join(ckpt, f"step-{s:08d}", "manifest.json")))["config"].get("seed")
        lost += winner_seed is not None and seed != winner_seed
    loads = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "..", "..", "tools",
                            "checkpoint_to_torch.py"), ckpt, "--list"], capture_output=True).returncode == 0
    lost += 0 if loads else 1
    t_end = refused.first_line(r"meshrun: .*failed")[0] if refused else None
    orphans = len(job_processes(ports[0])) + len(job_processes(ports[1]))
    return dict(hang=not finished, detection=(t_end - max(t0, refused.start)) if t_end else None, named=named,
                orphans=orphans, leftovers=len(shm_segments() - shm_before), lost=lost,
                variant="second job refused" if refused is b else "first job refused" if refused is a else "neither",
                said=None if named else (refused or b).text().splitlines()[-6:])


def trial_rewritten_in_place(i, layout, shm_before, workdir):
    """The shard every rank maps gets 4 KiB of valid ids (letters) written in place, the size unchanged, 0-1 s
    after the first checkpoint of a job that saves every step (--steps 100000 --save-every 1 --keep-last 1000). Named: the job failed
    naming d_000000.bin and "changed while training". Time: from the write to meshrun's failure line. Lost: a
    checkpoint committed for a step after the one in progress at the write (trained on the new bytes), plus the
    checkpoints saved before the write that changed, plus one when `latest` no longer loads whole."""
    rnd = random.Random(i)
    shared = os.path.join(workdir, "shared")
    shard = make_shards(shared, token_text(1))
    ckpt = os.path.join(workdir, "ckpt")
    port = free_port()
    extra = ["--vocab", "256", "--data", "d_*.bin", "--steps", "100000", "--save-dir", ckpt, "--save-every", "1",
             "--keep-last", "1000"]
    job = Job(meshrun(port, layout, extra), cwd=shared)
    # Once the job trains (its first checkpoint), at a random moment of it: a
    # write before the ranks have read the file is a file they start from.
    deadline = time.time() + HANG
    while not os.path.exists(os.path.join(ckpt, "latest")) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(rnd.uniform(0.0, 1.0))
    committed = checkpoint_steps(ckpt)  # a step directory still being written is not in what must stay
    before = {path: digest for path, digest in file_hashes(ckpt).items()
              if path.split("/")[0] in {f"step-{s:08d}" for s in committed}}
    step_at_write = max(committed or [0]) + 1  # the step in progress (or just finished)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.seek(rnd.randrange(1024, size - 4096, 2))
        f.write(bytes(rnd.choice(b"etaoinsrh") if k % 2 == 0 else 0 for k in range(4096)))
    t0 = time.time()
    finished = job.wait()
    late = sum(1 for s in checkpoint_steps(ckpt) if s > step_at_write)
    lost = late + lost_checkpoint_files(before, ckpt)
    r = refusal_result(job, finished, r"d_000000\.bin changed while training", t0, lost, shm_before, port)
    r["variant"] = "valid ids, same size"
    return r
# Stranger frames during start (issue 54, item 5): what a process without the token sends to node 0's store while
# it waits for node 1: (variant, the frames, what node 0 must say naming the stranger's address).
STRANGERS = ["decline", "wrong MAC", "request first", "hello first", "huge frame", "ten declines"]


def store_frame(command, *fields):
    """One frame of the store's protocol (src/comm/store_protocol.h): a command byte, each field as its int64 length
    and its bytes, after the frame's uint32 length."""
    body = bytes([command]) + b"".join(struct.pack("<q", len(f)) + f for f in fields)
    return struct.pack("<I", len(body)) + body


def stranger_bytes(how):
    return {"decline": store_frame(11), "wrong MAC": store_frame(10, os.urandom(32)),
            "request first": store_frame(9, b"g0/r0", b"forged by a stranger"),
            "hello first": store_frame(6, b"g0/r0"), "huge frame": struct.pack("<I", 0x7FFFFFF0) + os.urandom(60),
            "ten declines": store_frame(11)}[how]


def knock(port, payload, timeout=20):
    """Connects to 127.0.0.1:port as a stranger (waiting for it to listen), reads the greeting, sends `payload`, and
    reads until the store closes. Returns the stranger's own address ("127.0.0.1:40312") and when it sent."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = socket.socket()
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            s.close()
            time.sleep(0.02)
            continue
        with s:
            s.settimeout(15)
            s.recv(4096)
            sent = time.time()
            s.sendall(payload)
            try:
                while s.recv(4096):
                    pass
            except OSError:  # the store resets refused connections
                pass
            return "127.0.0.1:%d" % s.getsockname()[1], sent
    return None, None


def two_nodes(port, token, layout, extra, node0_flags=(), node1_flags=()):
    """The meshrun command of each of two nodes of 2 ranks on loopback (token: a file, or None)."""
    def node(rank, flags):
        args = [os.path.join(BIN, "meshrun"), "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(rank),
                "--master-port", str(port), "--grace-seconds", "1", "--rdzv-timeout", "30"]
        args += (["--rdzv-token-file", token] if token else []) + list(flags)
        return args + ["--", os.path.join(BIN, "meshtrain")] + GPT + layout + extra
    env = {k: v for k, v in os.environ.items() if k != "MESHTRAIN_RDZV_TOKEN"}
    return node(0, node0_flags), node(1, node1_flags), env


def write_token(workdir, name="token"):
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(os.urandom(16).hex() + "\n")
    return path


def trial_stranger_frames(i, layout, shm_before, workdir, template):
    """STRANGERS[i]: node 0 of a two-node job (with a token, resuming a saved 10-step run to step 20) is sent a
    stranger's frames while it waits; node 1 starts 0.3-1.5 s later. Detection: from the stranger's frame to node
    0's first line naming the stranger's address. Named: both nodes trained to the end (exit 0) and node 0 said the
    stranger's address (the refusal for the frames refused for their token, the store's line for a huge frame).
    Lost: files of the saved checkpoints changed or missing, plus one when the last step's checkpoint is not there."""
    how = STRANGERS[(i // 2) % len(STRANGERS)]  # each variant on both layouts in turn
    ckpt = os.path.join(workdir, "ckpt")
    shutil.copytree(template, ckpt)
    before = file_hashes(ckpt)
    port = free_port()
    cmd0, cmd1, env = two_nodes(port, write_token(workdir), layout,
                                ["--steps", "20", "--save-dir", ckpt, "--save-every", "5", "--resume"])
    node0 = Job(cmd0, env=env)
    strangers = [knock(port, stranger_bytes(how)) for _ in range(10 if how == "ten declines" else 1)]
    address, t_sent = strangers[0]
    time.sleep(random.uniform(0.3, 1.5))
    node1 = Job(cmd1, env=env)
    finished = node1.wait() and node0.wait()
    said = r"closed the connection from " if how == "huge frame" else r"meshrun: while waiting for .*refused "
    t_said, _ = node0.first_line(said + r".*" + re.escape(address or "?") + r"\b") if address else (None, None)
    named = bool(t_said) and node0.proc.returncode == 0 and node1.proc.returncode == 0
    last = os.path.exists(os.path.join(ckpt, "step-00000020"))
    orphans = len(job_processes(port))
    for p, _ in job_processes(port):
        os.kill(p, signal.SIGKILL)
    return dict(hang=not finished, detection=(t_said - t_sent) if t_said else None, named=named, orphans=orphans,
                leftovers=len(shm_segments() - shm_before), lost=lost_checkpoint_files(before, ckpt) + (0 if last else 1),
                variant=how, said=None if named else [l for _, l in node0.lines if "loss" not in l][-6:])


# meshrun flag mismatches (issue 54, item 6): (variant, node 0's extra meshrun flags, node 1's, whether node 0 has
# the token file, the sentence both nodes must say).
FLAG_MISMATCHES = [
    ("--nproc-per-node 2 / 1", [], ["--nproc-per-node", "1"], True,
     r"node 1's meshrun has --nproc-per-node 1 and node 0's has --nproc-per-node 2: start every node's meshrun"),
    ("--nnodes 2 / 3", [], ["--nnodes", "3"], True, r"node 1's meshrun has --nnodes 3 and node 0's has --nnodes 2: "),
    ("--nnodes 2 / 1:2", [], ["--nnodes", "1:2"], True,
     r"node 1's meshrun has --nnodes 1:2 and node 0's has --nnodes 2: "),
    ("--max-restarts 1 / 0", ["--max-restarts", "1"], [], True,
     r"node 1's meshrun has --max-restarts 0 and node 0's has --max-restarts 1: "),
    ("token on node 1 only", [], [], False,
     r"node 1's meshrun has a rendezvous token \(--rdzv-token-file .*\) and node 0's has no rendezvous token: "),
]


def trial_flag_mismatch(i, layout, shm_before, workdir, template):
    """FLAG_MISMATCHES[i]: two meshrun nodes of 2 ranks resuming a saved 10-step run, one started with another
    meshrun flag (or only node 1 with the token file); the nodes start in a random order 0-1 s apart. Detection: from
    the second node's start to the later of the two nodes' lines naming the difference. Named: both nodes exit 2 and
    both say the sentence (node, flag, both values, the fix). Lost: files of the saved checkpoints changed or
    missing (tools/checkpoint_to_torch.py loads `latest`)."""
    name, flags0, flags1, token0, expected = FLAG_MISMATCHES[(i // 2) % len(FLAG_MISMATCHES)]
    ckpt = os.path.join(workdir, "ckpt")
    shutil.copytree(template, ckpt)
    before = file_hashes(ckpt)
    port = free_port()
    token = write_token(workdir)
    extra = ["--steps", "30", "--save-dir", ckpt, "--save-every", "5", "--resume"]
    cmd0, cmd1, env = two_nodes(port, token, layout, extra, flags0, flags1)
    if not token0:  # node 0 without the token file, node 1 with it
        cmd0 = cmd0[:cmd0.index("--rdzv-token-file")] + cmd0[cmd0.index("--rdzv-token-file") + 2:]
    first, second = (cmd0, cmd1) if random.random() < 0.5 else (cmd1, cmd0)
    jobs = [Job(first, env=env)]
    time.sleep(random.uniform(0.0, 1.0))
    t0 = time.time()
    jobs.append(Job(second, env=env))
    finished = all([j.wait() for j in jobs])
    times = [j.first_line(expected)[0] for j in jobs]
    named = all(times) and all(j.proc.returncode == 2 for j in jobs)
    orphans = len(job_processes(port))
    for p, _ in job_processes(port):
        os.kill(p, signal.SIGKILL)
    return dict(hang=not finished, detection=(max(times) - t0) if all(times) else None, named=named, orphans=orphans,
                leftovers=len(shm_segments() - shm_before), lost=lost_checkpoint_files(before, ckpt), variant=name,
                said=None if named else [l for j in jobs for _, l in j.lines][-8:])


def summary(name, results):
    det = [r["detection"] for r in results if r["detection"] is not None]
    row = {"fault": name, "trials": len(results), "hangs": sum(r["hang"] for r in results),
           "detected": len(det), "named": sum(bool(r["named"]) for r in results),
           "orphans": sum(r["orphans"] for r in results), "leftovers": sum(r["leftovers"] for r in results)}
    if det:
        row.update(min=min(det), median=statistics.median(det), max=max(det))
    if "resumed" in results[0]:
        row["resumed_equal"] = sum(r["resumed"] for r in results)
    if "lost" in results[0]:
        row["lost"] = sum(r["lost"] for r in results)
    return row


def main():
    trials = int(os.environ.get("TRIALS", "50"))
    out = sys.argv[1] if len(sys.argv) > 1 else "build/bench/faults"
    os.makedirs(out, exist_ok=True)
    random.seed(int(os.environ.get("SEED", "1")))
    shm_before = shm_segments()
    faults = os.environ.get("FAULTS", "kill-rank,kill-in-save,stop-rank,kill-meshrun,kill-store,restart,disk-full,elastic,"
                            "desync-flag,changed-data").split(",")
    templates = tempfile.mkdtemp(prefix="meshtrain-faults-saved-")  # saved runs the trials resume
    for fault in faults:
        import partitions  # its trials import this module's helpers
        if fault in partitions.FAULTS:  # across two test hosts (needs root)
            results = partitions.run(fault, trials, int(os.environ.get("PARALLEL", "3")))
            with open(os.path.join(out, f"{fault}.json"), "w") as f:
                json.dump(results, f)
            continue
        results = []
        references = {}  # layout -> the uninterrupted run's losses
        for i in range(trials):
            layout = LAYOUTS[i % 2]
            with tempfile.TemporaryDirectory(prefix="meshtrain-faults-") as workdir:
                if fault == "restart":
                    key = " ".join(layout)
                    if key not in references:
                        ref = os.path.join(workdir, "ref.json")
                        subprocess.run([os.path.join(BIN, "meshrun"), "--nproc-per-node", "4", "--master-port", "0",
                                        "--quiet", "--", os.path.join(BIN, "meshtrain")] + GPT + layout +
                                       ["--steps", str(RESTART_STEPS), "--metrics-out", ref], check=True,
                                       capture_output=True)
                        references[key] = losses(ref)
                    r = trial_restart(layout, shm_before, workdir, references[key])
                    if r is None:
                        continue
                elif fault == "elastic":
                    key = " ".join(layout)
                    if key not in references:
                        ref = os.path.join(workdir, "ref.json")
                        subprocess.run([os.path.join(BIN, "meshtrain")] + ELASTIC_GPT + ["--metrics-out", ref],
                                       check=True, capture_output=True)
                        references[key] = losses(ref)
                    r = trial_elastic(layout, shm_before, workdir, references[key])
                    if r is None:
                        continue
                elif fault == "desync-flag":
                    key = " ".join(layout)
                    if key not in references:
                        references[key] = saved_run(os.path.join(templates, "desync-" + "-".join(layout)), layout,
                                                    [], templates)
                    r = trial_desync(i, layout, shm_before, workdir, references[key])
                elif fault in ("stranger-frames", "flag-mismatch"):
                    key = fault + " " + " ".join(layout)
                    if key not in references:
                        references[key] = saved_run(os.path.join(templates, "nodes-" + "-".join(layout)), layout,
                                                    [], templates)
                    trial = trial_stranger_frames if fault == "stranger-frames" else trial_flag_mismatch
                    r = trial(i, layout, shm_before, workdir, references[key])
                elif fault == "changed-data":
                    r = trial_changed_data(i, layout, shm_before, workdir, os.path.join(templates, "data"))
                elif fault == "shared-save-dir":
                    r = trial_shared_save_dir(i, layout, shm_before, workdir)
                elif fault == "rewritten-in-place":
                    r = trial_rewritten_in_place(i, layout, shm_before, workdir)
                elif fault == "disk-full":
                    r = trial_disk_full(layout, shm_before, workdir)
                elif fault == "kill-meshrun":
                    r = trial_kill_meshrun(layout, shm_before, workdir)
                elif fault == "kill-store":
                    r = trial_kill_store(layout, shm_before, workdir)
                else:
                    r = trial_kill(fault, layout, shm_before, workdir)
            r["layout"] = " ".join(layout)
            results.append(r)
            print(fault, i, r, flush=True)
        with open(os.path.join(out, f"{fault}.json"), "w") as f:
            json.dump(results, f)
    shutil.rmtree(templates, ignore_errors=True)


if __name__ == "__main__":
    main()
