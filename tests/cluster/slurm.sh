#!/bin/sh
# A private Slurm cluster on the test hosts of hosts.sh: munged with its own
# key and socket in DIR, slurmctld on host 0 (the head node, which computes
# too), one slurmd per host inside that host's namespaces, so each node has its
# own hostname, address and /dev/shm as on a real cluster. Node names resolve
# through DIR/hosts, bind-mounted as each host's /etc/hosts (no DNS). Nothing
# outside DIR and the namespaces is touched; a failed `up` removes what it made.
#   slurm.sh up NAME N DIR [SUBNET]   hosts NAME0..NAME<N-1> (SUBNET.1.., default 10.77.0) and the cluster;
#                                     waits until every node is idle (exit 3: no hosts, i.e. no namespaces;
#                                     4: Slurm or munge missing)
#   slurm.sh run NAME DIR CMD...      a Slurm command (sbatch, squeue, scancel...) on the head node
#   slurm.sh down NAME N DIR          stops the daemons, removes the hosts and DIR
# Needs root (namespaces; slurmd starts jobs as their user), slurmctld, slurmd,
# slurm-client and munge (scripts/setup.sh --with-slurm).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cmd=$1 name=$2

# Kills the process whose pid FILE holds, if it still runs.
stop() { [ -f "$1" ] && kill "$(cat "$1")" 2>/dev/null || true; }

case $cmd in
  up)
    n=$3 dir=$4 subnet=${5:-10.77.0}
    for b in munged slurmctld slurmd sbatch; do
      command -v "$b" > /dev/null || { echo "slurm.sh: $b is not installed; run scripts/setup.sh --with-slurm" >&2; exit 4; }
    done
    mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
    dir=$(cd "$dir" && pwd)
    trap '"$0" down "$name" "$n" "$dir"' EXIT  # cleared once the cluster is up
    chmod 700 "$dir/munge"
    "$here/hosts.sh" up "$name" "$n" "$subnet" || { echo "slurm.sh: cannot make the test hosts" >&2; exit 3; }

    # munged refuses a key or socket directory that others may write; --force
    # accepts running from /tmp (sticky, world-writable) as root.
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 2>/dev/null
    chmod 400 "$dir/munge/munge.key"
    munged --force --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" \
      --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" \
      > "$dir/munge/munged.out" 2>&1 < /dev/null || { cat "$dir/munge/munged.out" >&2; exit 1; }

    : > "$dir/hosts"
    echo "127.0.0.1 localhost" >> "$dir/hosts"
    nodes="" i=0
    while [ "$i" -lt "$n" ]; do
      echo "$subnet.$((i + 1)) $name$i" >> "$dir/hosts"
      nodes="$nodes
NodeName=$name$i NodeAddr=$subnet.$((i + 1)) CPUs=4 State=UNKNOWN"
      i=$((i + 1))
    done
    # proctrack/linuxproc finds a step's processes by their parents in /proc,
    # so scancel reaches every rank without cgroups (not delegated here);
    # config_overrides: every node has the 4 CPUs said here whatever the machine has.
    cat > "$dir/slurm.conf" <<EOF
ClusterName=$name
SlurmctldHost=${name}0($subnet.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
$nodes
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$dir/slurm.conf" HOSTS_FILE="$dir/hosts"
    setsid "$here/hosts.sh" run "$name" 0 slurmctld -D -i > "$dir/slurmctld.out" 2>&1 < /dev/null &
    pids="$!" i=0
    while [ "$i" -lt "$n" ]; do
      mkdir -p "$dir/spool/$name$i"
      # slurmd initializes its cgroup plugin whatever the other plugins are, and
      # ip netns exec hid /sys/fs/cgroup under a fresh sysfs: an empty tmpfs
      # there is a cgroup v1 tree with no controllers, which none of ours needs.
      setsid "$here/hosts.sh" run "$name" "$i" sh -c 'mount -t tmpfs cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd &&
        mount -t cgroup -o none,name=meshtrain_test cgroup /sys/fs/cgroup/systemd && exec slurmd -D' \
        > "$dir/slurmd.$name$i.out" 2>&1 < /dev/null &
      pids="$pids $!" i=$((i + 1))
    done
    t=0
    until [ "$("$0" run "$name" "$dir" sinfo -h -N -t idle -o %N 2>/dev/null | wc -l)" -eq "$n" ]; do
      t=$((t + 1)) dead=""
      for p in $pids; do kill -0 "$p" 2>/dev/null || dead=1; done
      if [ "$t" -gt 60 ] || [ -n "$dead" ]; then
        echo "slurm.sh: the $n nodes were not idle after $((t / 2)) s${dead:+ (a daemon exited)}:" >&2
        "$0" run "$name" "$dir" sinfo -N >&2 || true
        tail -n 20 "$dir"/*.log "$dir"/*.out >&2 || true
        exit 1
      fi
      sleep 0.5
    done
    trap - EXIT
    echo "export SLURM_CONF=$dir/slurm.conf" ;;
  run)
    dir=$3; shift 3
    SLURM_CONF="$dir/slurm.conf" HOSTS_FILE="$dir/hosts" exec "$here/hosts.sh" run "$name" 0 "$@" ;;
  down)
    n=$3 dir=$4
    stop "$dir/slurmctld.pid"
    for f in "$dir"/slurmd.*.pid; do stop "$f"; done
    "$here/hosts.sh" down "$name" "$n"  # kills whatever is left in the hosts: steps, ranks
    stop "$dir/munge/munged.pid"
    if [ -f "$dir/slurm.conf" ]; then rm -rf "$dir"; fi  # only what up made
    ;;
  *) echo "slurm.sh: unknown command $cmd" >&2; exit 2 ;;
esac
