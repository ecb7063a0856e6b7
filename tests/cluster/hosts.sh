#!/bin/sh
# Test hosts on one machine: each a network namespace with its own hostname and
# its own /dev/shm (the machine's /dev/shm/testhost-NAME<I>, bound in a private
# mount namespace, so what a host leaves there can be seen from outside), joined by veth links
# to a bridge that lives in a namespace of its own, so nothing is added to the
# machine's own network.
#   hosts.sh up NAME N [SUBNET]   hosts NAME0..NAME<N-1> at SUBNET.1.. (default 10.77.0), switch NAMEsw
#   hosts.sh run NAME I CMD...    CMD on host I (hostname NAME<I>, its own /dev/shm; with HOSTS_FILE set,
#                                 that file as its /etc/hosts, so host names resolve without DNS)
#   hosts.sh cut NAME I           host I's link goes down (on the switch's side: the host sees nothing)
#   hosts.sh cut-in NAME I        nothing reaches host I any more; what it sends still arrives (a one-way cut:
#                                 tbf with a bucket smaller than any packet drops them all; this kernel has
#                                 no netem and no tc classifiers)
#   hosts.sh cut-out NAME I       nothing host I sends arrives any more; what it is sent still arrives
#   hosts.sh shape NAME I RATE    host I's link shaped to RATE (tc tbf, e.g. 200mbit; this kernel has no netem)
#   hosts.sh down NAME N          removes everything (the processes in the hosts first)
set -eu
cmd=$1 name=$2
case $cmd in
  up)
    n=$3 subnet=${4:-10.77.0}
    ip netns add "${name}sw"
    ip -n "${name}sw" link add name bridge0 type bridge
    ip -n "${name}sw" link set bridge0 up
    i=0
    while [ "$i" -lt "$n" ]; do
      ip netns add "$name$i"
      ip link add "${name}h$i" type veth peer name "${name}s$i"
      ip link set "${name}h$i" netns "$name$i"
      ip link set "${name}s$i" netns "${name}sw"
      ip -n "${name}sw" link set "${name}s$i" master bridge0 up
      ip -n "$name$i" link set lo up
      ip -n "$name$i" addr add "$subnet.$((i + 1))/24" dev "${name}h$i"
      ip -n "$name$i" link set "${name}h$i" up
      i=$((i + 1))
    done ;;
  run)
    i=$3; shift 3
    exec ip netns exec "$name$i" unshare --uts --mount sh -c \
      'mkdir -p "/dev/shm/testhost-$0" && mount --bind "/dev/shm/testhost-$0" /dev/shm && hostname "$0" &&
       { [ -z "${HOSTS_FILE:-}" ] || mount --bind "$HOSTS_FILE" /etc/hosts; } && exec "$@"' "$name$i" "$@" ;;
  cut)
    ip -n "${name}sw" link set "${name}s$3" down ;;
  cut-in)
    ip netns exec "${name}sw" tc qdisc replace dev "${name}s$3" root tbf rate 8bit burst 16 limit 16 ;;
  cut-out)
    ip netns exec "$name$3" tc qdisc replace dev "${name}h$3" root tbf rate 8bit burst 16 limit 16 ;;
  shape)
    ip netns exec "${name}sw" tc qdisc replace dev "${name}s$3" root tbf rate "$4" burst 64kb latency 50ms ;;
  down)
    n=$3 i=0
    while [ "$i" -lt "$n" ]; do
      for pid in $(ip netns pids "$name$i" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$name$i" 2>/dev/null || true
      rm -rf "/dev/shm/testhost-$name$i"
      i=$((i + 1))
    done
    ip netns del "${name}sw" 2>/dev/null || true ;;
  *) echo "hosts.sh: unknown command $cmd" >&2; exit 2 ;;
esac
