#!/bin/sh
# OpenMPI's launch agent for the test hosts of hosts.sh, in place of ssh:
#   mpirun --mca plm_rsh_agent tests/cluster/mpi_agent.sh --hostfile H ...
# mpirun's rsh launcher calls it as `mpi_agent.sh HOST CMD...` to start its
# daemon (orted) on HOST, where HOST is a host's address (10.77.0.2) or name
# (mt2); the daemon then starts that host's ranks, so they share the host's
# /dev/shm (OpenMPI's shared memory inside it) and reach the others over its
# link. CMD is words for a remote shell, as ssh would pass them (OpenMPI quotes
# its URIs for one), so a shell here runs them inside the host (hosts.sh run).
# Run mpirun itself on host 0 (hosts.sh run NAME 0 mpirun ...): the daemons
# connect back to it, and it starts host 0's ranks without this agent.
set -eu
host=$1; shift
here=$(dirname "$0")
# The namespace is the host's name, or the one holding its address.
ns=
if ip netns list 2>/dev/null | cut -d' ' -f1 | grep -qx "$host"; then
  ns=$host
else
  for candidate in $(ip netns list 2>/dev/null | cut -d' ' -f1); do
    if ip -n "$candidate" -o -4 addr show 2>/dev/null | grep -qF " inet $host/"; then ns=$candidate; break; fi
  done
fi
[ -n "$ns" ] || { echo "mpi_agent.sh: no test host has the name or address '$host' (ip netns list)" >&2; exit 255; }
# hosts.sh names host I of NAME's link NAMEh<I> inside the host.
link=$(ip -n "$ns" -o link show 2>/dev/null | sed -n 's/^[0-9]*: \([^:@]*h[0-9][0-9]*\)@.*/\1/p' | head -n 1)
name=${link%h*} i=${link##*h}
[ "$name$i" = "$ns" ] || { echo "mpi_agent.sh: '$ns' is not a host of hosts.sh (its link is '$link')" >&2; exit 255; }
exec "$here/hosts.sh" run "$name" "$i" sh -c "$*"
