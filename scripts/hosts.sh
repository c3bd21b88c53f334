#!/bin/sh
# hosts.sh: several emulated hosts on this one machine, for multi-host tests.
#
#   sh scripts/hosts.sh up N [--rate 1gbit] [--delay 50us]
#   sh scripts/hosts.sh down
#   sh scripts/hosts.sh exec I cmd [args...]
#   sh scripts/hosts.sh status
#   sh scripts/hosts.sh run N [--rate 1gbit] [--delay 50us] cmd [args...]
#
# `up` makes N network namespaces tdhost0 .. tdhost<N-1>. Host I has loopback and one veth
# end, tdeth0, with address 10.77.0.<10+I>/24; the other ends are ports of the bridge tdbr0
# in a namespace of its own (tdbridge), so nothing touches this machine's own interfaces
# and the traffic between hosts stays on these addresses. Each host's egress is shaped:
# rate with tbf (TCP then gets ~95% of it), and the propagation delay with netem where the
# kernel has sch_netem. Where it has not (the project's VMs), the delay is added on each
# host's ingress instead by scripts/hosts-delay.c, an NFQUEUE helper built here with cc,
# one per host, which needs iptables. Either way a ping between two hosts takes about
# twice --delay more than an unshaped one (measure with `ping -U`: plain ping times the
# reply on arrival, before an ingress delay). `--rate none` and `--delay 0` turn either off.
# The root namespace has no address on 10.77.0.0/24: run launchers inside a host, e.g.
# `sh scripts/hosts.sh exec 0 mpirun ...`.
#
# `exec I cmd` runs cmd inside host I: its network namespace, its own hostname (tdhostI, in
# a UTS namespace of its own), /etc/hosts naming every host, and a /dev/shm of its own (a
# tmpfs per host, mounted at /run/tdhosts/shm/tdhostI), so that shared memory cannot join
# two "hosts" by accident. `down` stops whatever still runs inside the hosts and removes
# everything `up` made; it is safe to run at any time, also after a failed `up` (which
# cleans up after itself anyway).
#
# `run` is what tests and benchmarks use: it waits for the hosts' lock (/run/lock/tandem-hosts.lock,
# so that two runs never share the hosts), clears whatever a crashed run left, brings N hosts up,
# runs cmd (in the root namespace; it reaches the hosts with `exec`), and always takes them down
# again, whatever cmd does, exiting with cmd's status.
#
# It does not emulate loss, jitter, reordering or separate file systems (the hosts share
# this machine's files, /tmp included), and it does not start any job: see
# scripts/netns-agent.sh for mpirun. Needs root, iproute2 and, without netem, cc + iptables.
set -e

PREFIX=tdhost          # host I is namespace and hostname tdhost$I
BRNS=tdbridge          # the namespace holding the bridge
BR=tdbr0
DEV=tdeth0             # each host's interface
SUBNET=10.77.0         # host I is $SUBNET.$((10 + I))
STATE=/run/tdhosts     # shm mounts, the delay helper
MAXHOSTS=64

usage() {
    cat >&2 <<EOF
usage: sh scripts/hosts.sh up N [--rate RATE] [--delay DELAY]
       sh scripts/hosts.sh down
       sh scripts/hosts.sh exec I cmd [args...]
       sh scripts/hosts.sh status
       sh scripts/hosts.sh run N [--rate RATE] [--delay DELAY] cmd [args...]
  N      number of hosts, 1..$MAXHOSTS (namespaces ${PREFIX}0 .. ${PREFIX}N-1)
  RATE   egress rate of every host, tc units (100mbit, 1gbit, 10gbit) or none (default 1gbit)
  DELAY  one-way delay of every packet between hosts, us or ms (50us, 1ms) or 0 (default 50us)
  I      host index, 0..N-1
EOF
    exit 2
}

die() {
    echo "hosts.sh: $*" >&2
    exit 1
}

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, veth, tc)"

# Our namespaces, hosts first, one per line.
our_netns() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+\$" || true
    ip netns list 2>/dev/null | awk '{print $1}' | grep -x "$BRNS" || true
}

# Stops every process inside namespace $1 (TERM, then KILL after about 2 s).
stop_procs() {
    pids=$(ip netns pids "$1" 2>/dev/null || true)
    [ -n "$pids" ] || return 0
    kill -TERM $pids 2>/dev/null || true
    n=0
    while [ $n -lt 20 ]; do
        pids=$(ip netns pids "$1" 2>/dev/null || true)
        [ -n "$pids" ] || return 0
        sleep 0.1
        n=$((n + 1))
    done
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
}

teardown() {
    for ns in $(our_netns); do stop_procs "$ns"; done
    for ns in $(our_netns); do ip netns delete "$ns" 2>/dev/null || true; done
    # A veth made before it could be moved into its namespace would sit here.
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
               grep -E "^(tdport[0-9]+|$DEV|$BR)\$" || true); do
        ip link delete "$l" 2>/dev/null || true
    done
    if [ -d "$STATE/shm" ]; then
        for d in "$STATE"/shm/*; do
            [ -d "$d" ] || continue
            umount "$d" 2>/dev/null || umount -l "$d" 2>/dev/null || true
            rmdir "$d" 2>/dev/null || true
        done
    fi
    rm -rf "$STATE"
    for d in /etc/netns/${PREFIX}*; do
        [ -d "$d" ] || continue
        case "$(basename "$d")" in "$PREFIX"*[!0-9]*) continue ;; esac
        rm -rf "$d"
    done
    rmdir /etc/netns 2>/dev/null || true
}

is_uint() {
    case "$1" in '' | *[!0-9]*) return 1 ;; esac
}

# Prints the delay in microseconds, or fails.
delay_us() {
    case "$1" in
        0) echo 0 ;;
        *us) v=${1%us}; is_uint "$v" && echo "$v" ;;
        *ms) v=${1%ms}; is_uint "$v" && echo $((v * 1000)) ;;
        *) return 1 ;;
    esac
}

check_rate() {
    case "$1" in
        none) return 0 ;;
        *kbit | *mbit | *gbit) v=${1%?bit}; is_uint "$v" && [ "$v" -gt 0 ] ;;
        *) return 1 ;;
    esac
}

# Shapes host $1's link: egress delay (netem) then rate, or rate then ingress delay.
shape() {
    ns=$PREFIX$1
    parent=root
    if [ "$delay" -gt 0 ] && [ "$use_netem" = yes ]; then
        tc -n "$ns" qdisc add dev $DEV root handle 1: netem delay "${delay}us" limit 100000
        parent="parent 1:1"
    fi
    if [ "$rate" != none ]; then
        # burst: two 64 KB GSO packets, so that tbf never has to split one; the queue holds
        # 5 ms at the rate, like a switch port's buffer.
        tc -n "$ns" qdisc add dev $DEV $parent handle 10: tbf rate "$rate" burst 131072 latency 5ms
    fi
    if [ "$delay" -gt 0 ] && [ "$use_netem" = no ]; then
        # On ingress, where the kernel timestamps each packet on arrival: the helper counts
        # the delay from there. Each direction still pays the delay once, after the rate.
        ip netns exec "$ns" iptables -t mangle -A PREROUTING -i $DEV \
            -j NFQUEUE --queue-num 0 --queue-bypass
        # Real-time priority: busy-polling ranks must not starve the emulated wire.
        ip netns exec "$ns" setsid chrt -f 10 "$STATE/hosts-delay" 0 "$delay" \
            </dev/null >"$STATE/delay.$1.log" 2>&1 &
        echo $! >"$STATE/delay.$1.pid"
    fi
}

cmd_up() {
    [ $# -ge 1 ] || usage
    n=$1
    shift
    is_uint "$n" && [ "$n" -ge 1 ] && [ "$n" -le $MAXHOSTS ] || usage
    rate=1gbit
    delay_arg=50us
    while [ $# -gt 0 ]; do
        case "$1" in
            --rate) [ $# -ge 2 ] || usage; rate=$2; shift 2 ;;
            --rate=*) rate=${1#--rate=}; shift ;;
            --delay) [ $# -ge 2 ] || usage; delay_arg=$2; shift 2 ;;
            --delay=*) delay_arg=${1#--delay=}; shift ;;
            *) echo "hosts.sh: unknown option '$1'" >&2; usage ;;
        esac
    done
    check_rate "$rate" || { echo "hosts.sh: bad rate '$rate'" >&2; usage; }
    delay=$(delay_us "$delay_arg") || { echo "hosts.sh: bad delay '$delay_arg'" >&2; usage; }
    [ -z "$(our_netns)" ] || die "hosts are already up (sh scripts/hosts.sh down first)"

    trap 'rc=$?; trap - EXIT; if [ $rc -ne 0 ]; then
              echo "hosts.sh: up failed, removing what it made" >&2; teardown; fi; exit $rc' EXIT
    trap 'exit 130' INT TERM HUP

    mkdir -p "$STATE/shm" /etc/netns
    ip netns add $BRNS
    ip -n $BRNS link set lo up
    ip -n $BRNS link add $BR type bridge
    ip -n $BRNS link set $BR up

    hosts_file=$STATE/hosts
    cat /etc/hosts >"$hosts_file"
    i=0
    while [ $i -lt "$n" ]; do
        echo "$SUBNET.$((10 + i)) $PREFIX$i" >>"$hosts_file"
        i=$((i + 1))
    done

    # Which delay mechanism: netem where the kernel has it.
    use_netem=no
    if [ "$delay" -gt 0 ]; then
        ip -n $BRNS link add tdprobe type veth peer name tdprobe1
        if tc -n $BRNS qdisc add dev tdprobe root netem delay 1us 2>/dev/null; then use_netem=yes; fi
        ip -n $BRNS link delete tdprobe
        if [ $use_netem = no ]; then
            command -v iptables >/dev/null || die "the kernel has no netem and iptables is missing (apt-get install iptables)"
            cc -O2 -o "$STATE/hosts-delay" "$(dirname "$0")/hosts-delay.c" ||
                die "cannot build the delay helper (needs cc)"
        fi
    fi

    i=0
    while [ $i -lt "$n" ]; do
        ns=$PREFIX$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add tdport$i netns $BRNS type veth peer name $DEV netns "$ns"
        ip -n $BRNS link set tdport$i master $BR
        ip -n $BRNS link set tdport$i up
        ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev $DEV
        ip -n "$ns" link set $DEV up
        mkdir -p "$STATE/shm/$ns" "/etc/netns/$ns"
        mount -t tmpfs -o mode=1777 "tdhost-shm" "$STATE/shm/$ns"
        cp "$hosts_file" "/etc/netns/$ns/hosts"
        echo "$ns" >"/etc/netns/$ns/hostname"
        shape $i
        i=$((i + 1))
    done

    if [ "$delay" -gt 0 ] && [ $use_netem = no ]; then
        sleep 0.2
        i=0
        while [ $i -lt "$n" ]; do
            kill -0 "$(cat "$STATE/delay.$i.pid")" 2>/dev/null ||
                die "the delay helper of $PREFIX$i stopped: $(cat "$STATE/delay.$i.log")"
            i=$((i + 1))
        done
    fi
    trap - EXIT INT TERM HUP
    if [ "$delay" -eq 0 ]; then how="no delay"
    elif [ $use_netem = yes ]; then how="delay ${delay}us each way (netem, egress)"
    else how="delay ${delay}us each way (hosts-delay helper, ingress)"; fi
    rate_how="rate $rate per host (tbf, egress)"
    [ "$rate" != none ] || rate_how="no rate limit"
    echo "hosts.sh: $n hosts up; $rate_how, $how"
    i=0
    while [ $i -lt "$n" ]; do
        echo "  $PREFIX$i  $SUBNET.$((10 + i))  ($DEV)"
        i=$((i + 1))
    done
}

cmd_exec() {
    [ $# -ge 2 ] || usage
    is_uint "$1" || usage
    ns=$PREFIX$1
    shift
    ip netns list | awk '{print $1}' | grep -qx "$ns" || die "no host $ns (is it up?)"
    # ip netns exec gives the command a mount namespace of its own (and bind-mounts
    # /etc/netns/$ns/hosts over /etc/hosts), so the /dev/shm mount stays inside it.
    exec ip netns exec "$ns" unshare --uts sh -c \
        'hostname "$1" && mount --bind "$2" /dev/shm && shift 2 && exec "$@"' \
        sh "$ns" "$STATE/shm/$ns" "$@"
}

cmd_run() {
    [ $# -ge 2 ] || usage
    n=$1
    shift
    opts=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --rate | --delay) [ $# -ge 2 ] || usage; opts="$opts $1 $2"; shift 2 ;;
            --rate=* | --delay=*) opts="$opts $1"; shift ;;
            *) break ;;
        esac
    done
    [ $# -ge 1 ] || usage
    mkdir -p /run/lock
    exec 9>/run/lock/tandem-hosts.lock
    flock 9
    teardown
    trap 'teardown' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP
    # shellcheck disable=SC2086 # the options are words
    (cmd_up "$n" $opts) || exit 1
    rc=0
    "$@" 9>&- || rc=$?
    exit $rc
}

cmd_status() {
    for ns in $(our_netns); do
        [ "$ns" = $BRNS ] && continue
        echo "$ns: $(ip -n "$ns" -o -4 addr show dev $DEV 2>/dev/null | awk '{print $4}')"
        tc -n "$ns" -s qdisc show dev $DEV | sed 's/^/  /'
    done
}

[ $# -ge 1 ] || usage
verb=$1
shift
case "$verb" in
    up) cmd_up "$@" ;;
    down) [ $# -eq 0 ] || usage; teardown ;;
    exec) cmd_exec "$@" ;;
    status) [ $# -eq 0 ] || usage; cmd_status ;;
    run) cmd_run "$@" ;;
    *) usage ;;
esac
