#!/bin/sh
# netns-agent.sh: an ssh stand-in for Open MPI's mpirun, so that a job spans the emulated
# hosts of scripts/hosts.sh through Open MPI's real remote launch path (rsh plm -> orted).
#
#   sh scripts/hosts.sh up 2
#   sh scripts/hosts.sh exec 0 mpirun --allow-run-as-root \
#       --mca plm_rsh_agent "$PWD/scripts/netns-agent.sh" --hostfile HOSTFILE -np 4 prog
#
# with HOSTFILE lines like "tdhost0 slots=2"; add --mca btl self,vader,tcp
# --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 to pin the
# traffic to the emulated links, and --mca mpi_yield_when_idle 1 when the hosts together
# run more ranks than the machine has cores. mpirun calls it the way it calls ssh:
# `netns-agent.sh [ssh options] HOST word...`. HOST is tdhostI, its address 10.77.0.<10+I>,
# or either with a "user@" in front; the words are joined with spaces and run by sh -c
# inside host I (scripts/hosts.sh exec I), as sshd would run them with the login shell.
#
# It does not authenticate, forward X11 or agents, allocate a terminal, or reach anything
# but the hosts of scripts/hosts.sh on this machine.
set -e

here=$(cd "$(dirname "$0")" && pwd)

# ssh options Open MPI or a user may pass: skip them (and the value of those that take one).
while [ $# -gt 0 ]; do
    case "$1" in
        -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "usage: netns-agent.sh [ssh options] HOST command..." >&2
    echo "  HOST: tdhostI or 10.77.0.<10+I>, a host of scripts/hosts.sh" >&2
    exit 255
fi
host=${1#*@}
shift
case "$host" in
    tdhost[0-9]*) i=${host#tdhost} ;;
    10.77.0.[0-9]*) i=$((${host#10.77.0.} - 10)) ;;
    *) i= ;;
esac
case "$i" in
    '' | *[!0-9]*)
        echo "netns-agent.sh: '$host' is not a host of scripts/hosts.sh (tdhostI or 10.77.0.<10+I>)" >&2
        exit 255
        ;;
esac
exec sh "$here/hosts.sh" exec "$i" sh -c "$*"
