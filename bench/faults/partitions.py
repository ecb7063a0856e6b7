#!/usr/bin/python3
"""Partition campaign (issue 30): faults of links and hosts, on two test hosts.

    sudo FAULTS=cut,cut-in,cut-out,frozen-host,slow-link bench/faults/run.sh

Each trial makes two test hosts (tests/cluster/hosts.sh: network namespaces with their own hostname,
address and /dev/shm, joined through a bridge), starts a meshrun node of 2 ranks on each (a tiny GPT,
dp 2 x pp 2 or dp 2 x tp 2, alternating; the store on host 0; MESHTRAIN_LINK_TIMEOUT_S=4,
--comm-timeout 6), injects one fault into host 1 at a random moment 1-3 s into training, and records:
  detection  seconds from the fault to node 0's first line naming a failure
  end        seconds from the fault until every node that can still run has exited
  named      node 0's summary names a rank of host 1 (unreachable, through the link to host 1; frozen:
             stopped making progress) and, where host 1 can still run, node 1 names its link to the store
  orphans    processes left in a host that can still run (a frozen host's are frozen by the fault)
  leftovers  files left in those hosts' /dev/shm
Faults:
  cut          host 1's link down (both ways)
  cut-in       nothing reaches host 1 any more; what it sends still arrives
  cut-out      nothing host 1 sends arrives any more; what it is sent still arrives
  frozen-host  SIGSTOP of every process of host 1
  slow-link    host 1's link from 1 Gbit/s to 10 Mbit/s (100x slower): the job must go on, no false
               failure; detection is then the step time after / before, and after 6 s both meshruns get
               SIGTERM: end = until both exited (must be within a second or so)
Trials run PARALLEL at a time (default 3): each waits on time-outs most of the time.
"""
import concurrent.futures, os, random, re, signal, subprocess, tempfile, time

from campaign import BIN, GPT, HANG, LAYOUTS, Job

HOSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "cluster", "hosts.sh")
FAULTS = ["cut", "cut-in", "cut-out", "frozen-host", "slow-link"]
LINK_TIMEOUT_S = 4
COMM_TIMEOUT_S = 6


def hosts(*args):
    return subprocess.run([HOSTS] + [str(a) for a in args], capture_output=True, text=True)


def pids(name, i):
    return subprocess.run(["ip", "netns", "pids", f"{name}{i}"], capture_output=True, text=True).stdout.split()


def shm_files(name, i):
    d = f"/dev/shm/testhost-{name}{i}"
    return os.listdir(d) if os.path.isdir(d) else []


def node(name, subnet, i, layout, token, extra):
    args = [HOSTS, "run", name, str(i), os.path.join(BIN, "meshrun"), "--nnodes", "2", "--node-rank", str(i),
            "--nproc-per-node", "2", "--master-addr", f"{subnet}.1", "--master-port", "29611",
            "--rdzv-token-file", token, "--grace-seconds", "1", "--", os.path.join(BIN, "meshtrain")]
    env = dict(os.environ, MESHTRAIN_LINK_TIMEOUT_S=str(LINK_TIMEOUT_S))
    return Job(args + GPT + layout + ["--steps", "100000", "--comm-timeout", str(COMM_TIMEOUT_S)] + extra, env=env)


def step_times(job, start, end):
    """Seconds per step from the progress lines' arrival times in [start, end)."""
    t = [t for t, line in job.lines if start <= t < end and re.search(r"step +\d+/", line)]
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def fault_command(fault, name):
    return {"cut": ["cut", name, 1], "cut-in": ["cut-in", name, 1], "cut-out": ["cut-out", name, 1],
            "slow-link": ["shape", name, 1, "10mbit"]}.get(fault)


def named(fault, subnet, n0, n1):
    summary = [line for _, line in n0.lines if line.startswith("meshrun: failed:")]
    if not summary:
        return False
    if fault == "frozen-host":
        return re.search(r"rank [23] stopped making progress", summary[-1]) is not None
    node0 = re.search(rf"rank [23] became unreachable \(the link to {re.escape(subnet)}\.2 went silent",
                      summary[-1]) is not None
    return node0 and f"the link to {subnet}.1 went silent" in n1.text()


def trial(fault, index, layout, workdir):
    name, subnet = f"pc{index}", f"10.{120 + index % 100}.{index // 100 % 250}"
    hosts("down", name, 2)
    if hosts("up", name, 2, subnet).returncode != 0:
        return dict(hang=False, detection=None, named=False, orphans=0, leftovers=0, error="hosts.sh up failed")
    try:
        token = os.path.join(workdir, "token")
        with open(token, "w") as f:
            f.write("0123456789abcdef0123456789abcdef\n")
        if fault == "slow-link":
            for i in (0, 1):
                hosts("shape", name, i, "1gbit")
        n1 = node(name, subnet, 1, layout, token, [])
        n0 = node(name, subnet, 0, layout, token, [])
        deadline = time.time() + 30
        while time.time() < deadline and not n0.first_line(r"step +\d+/")[0]:
            time.sleep(0.05)
        time.sleep(random.uniform(1.0, 3.0))
        t_fault = time.time()
        if fault == "frozen-host":
            for p in pids(name, 1):
                os.kill(int(p), signal.SIGSTOP)
        else:
            hosts(*fault_command(fault, name))
        if fault == "slow-link":
            return slow_link_result(name, n0, n1, t_fault)
        finished = n0.wait(HANG) and (fault == "frozen-host" or n1.wait(HANG))
        t_end = time.time()
        t_detect, _ = n0.first_line(r"meshrun: .*(failed|unreachable|stopped making progress|died|lost)",
                                    after=t_fault)
        alive = [0] if fault == "frozen-host" else [0, 1]
        return dict(hang=not finished, detection=(t_detect - t_fault) if t_detect else None, end=t_end - t_fault,
                    named=named(fault, subnet, n0, n1), orphans=sum(len(pids(name, i)) for i in alive),
                    leftovers=sum(len(shm_files(name, i)) for i in alive),
                    said=[line for _, line in n0.lines + n1.lines if line.startswith("meshrun:")][-6:])
    finally:
        hosts("down", name, 2)


def slow_link_result(name, n0, n1, t_fault):
    time.sleep(6)
    before, after = step_times(n0, t_fault - 3, t_fault), step_times(n0, t_fault + 1, t_fault + 6)
    failed = any(re.search(r"meshrun: .*(failed|unreachable|stopped making progress)", line) for _, line in
                 n0.lines + n1.lines)
    trained_on = n0.first_line(r"step +\d+/", after=t_fault + 5)[0] is not None
    t_term = time.time()
    for job in (n0, n1):
        job.proc.send_signal(signal.SIGTERM)
    finished = n0.wait(HANG) and n1.wait(HANG)
    end = time.time() - t_term
    return dict(hang=not finished, detection=(after / before) if before and after else None, end=end,
                named=trained_on and not failed, orphans=sum(len(pids(name, i)) for i in (0, 1)),
                leftovers=sum(len(shm_files(name, i)) for i in (0, 1)),
                said=[line for _, line in n0.lines + n1.lines if line.startswith("meshrun:")][-4:])


def run(fault, trials, parallel):
    """`trials` trials of `fault`, `parallel` at a time; the results in trial order."""
    def one(i):
        with tempfile.TemporaryDirectory(prefix="meshtrain-partitions-") as workdir:
            r = trial(fault, i, LAYOUTS[i % 2], workdir)
        r["layout"] = " ".join(LAYOUTS[i % 2])
        print(fault, i, r, flush=True)
        return r
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(one, range(trials)))
