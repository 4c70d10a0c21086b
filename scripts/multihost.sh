#!/usr/bin/env bash
# Several hosts on one machine: N network namespaces joined by a bridge, one command run on each.
#
#   scripts/multihost.sh [-n HOSTS] [-p PREFIX] [-d DELAY] [-b RATE] [-t SECONDS] [-g SECONDS] [-o DIR] -- 'COMMAND'
#
# Makes namespaces PREFIX-h0 .. PREFIX-h<N-1> (the hosts) and PREFIX-br (a bridge, br0, in a
# namespace of its own): host i holds one end of a veth pair, veth<i>, at 10.77.0.<i+1>/24, and
# its loopback; the other end is a port of br0. -d DELAY (tc's syntax: 0.5ms, 2ms) delays what
# each host sends by DELAY (netem on veth<i>, inside the host), so a link's round trip gains 2 DELAY;
# where tc or netem is missing, one line says so and the script exits 77. -b RATE (tc's syntax:
# 100mbit, 1gbit) limits what each host sends to RATE (tbf on veth<i>; with -d, netem's rate).
# Every link and address lives inside these namespaces: nothing outside them is created or addressed. COMMAND (a bash command line, quoted
# so that its variables expand on each host) runs on every host at once, from this directory, with
#   HOST_RANK=i  NUM_HOSTS=N  HOST_ADDR=10.77.0.<i+1>  MASTER_ADDR=10.77.0.1 (host 0)
#   MASTER_PORT=29400  GLOO_SOCKET_IFNAME=veth<i> (gloo's links go over the veth, not loopback)
# Once a host's command fails, the others are ended after -g SECONDS (default 30): the ranks end
# themselves when they lose a peer (liveness.py), but torchrun on a host that lost host 0 waits on
# its rendezvous store there for minutes after its ranks have exited.
# Each host's stdout and stderr are printed when all have ended, each line prefixed [h<i>], and kept
# in DIR/h<i>.out, .err, .status with -o, and veth<i>'s counters at the end in DIR/h<i>.link (`ip -j
# -s link`: the bytes and packets the host sent and received); then one line per host gives its exit status.
# The namespaces are removed on exit (and on Ctrl-C, SIGTERM, errors), their processes ended first;
# a run starts by removing what an aborted run with the same PREFIX left. Needs root (ip netns)
# and bash 5.1 (wait -n -p).
#
# Exit status: 0 if every host's command exited 0, else the status of the first to fail (124: it
# ran past -t SECONDS, default 900); 77 where namespaces cannot be made here or -d, -b cannot shape
# the links (one line says why); 2 for a usage error.
#
# Tensor parallelism over 2 hosts (generate.py, 1 rank per host, gloo):
#   scripts/multihost.sh -n 2 -- 'OMP_NUM_THREADS=1 .venv/bin/torchrun --nnodes $NUM_HOSTS \
#     --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT \
#     --local_addr $HOST_ADDR --rdzv_conf is_host=$((HOST_RANK == 0)) \
#     generate.py --checkpoint checkpoints/smollm2-135m --prompt "Once upon a time" --no-compile'
# Pipeline parallelism over the same 2 hosts (a stage of 15 layers on each): add --pp 2.
# The c10d rendezvous numbers the nodes itself (by address: host 0 holds rank 0), so there is no
# --node_rank. --local_addr and is_host: the namespaces share this machine's host name, which
# resolves to 127.0.0.1, so torchrun can learn from it neither its own address nor whether it
# holds the endpoint. On real machines, drop those two flags; the endpoint is host 0's address.
# OMP_NUM_THREADS=1: here all the hosts share this machine's cores.
set -uo pipefail

HOSTS=2 PREFIX=minillm TIMEOUT=900 GRACE=30 DIR= DELAY= RATE=
usage() { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
while getopts "n:p:d:b:t:g:o:h" opt; do
  case $opt in
    n) HOSTS=$OPTARG ;; p) PREFIX=$OPTARG ;; t) TIMEOUT=$OPTARG ;; g) GRACE=$OPTARG ;; o) DIR=$OPTARG ;; d) DELAY=$OPTARG ;; b) RATE=$OPTARG ;;
    h) usage ;; *) usage 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || usage 2
COMMAND="$*"
[[ $HOSTS =~ ^[1-9][0-9]*$ && $HOSTS -le 200 ]] || { echo "multihost.sh: -n takes 1 to 200 hosts" >&2; exit 2; }
[[ $PREFIX =~ ^[a-z][a-z0-9-]{0,23}$ ]] || { echo "multihost.sh: -p: a short lowercase name" >&2; exit 2; }
[[ -z $DELAY || $DELAY =~ ^[0-9.]+(us|ms|s)$ ]] || { echo "multihost.sh: -d: a delay such as 0.5ms" >&2; exit 2; }
[[ -z $RATE || $RATE =~ ^[0-9.]+([kmg]?bit)$ ]] || { echo "multihost.sh: -b: a rate such as 100mbit" >&2; exit 2; }
[[ $TIMEOUT =~ ^[0-9]+$ && $GRACE =~ ^[0-9]+$ ]] || { echo "multihost.sh: -t, -g take whole seconds" >&2; exit 2; }
SUBNET=10.77.0 BRIDGE=$PREFIX-br
host() { echo "$PREFIX-h$1"; }

# The namespaces that this script makes with PREFIX, from this run or an aborted one
ours() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(h[0-9]+|br)$"; }

# SIGTERM to every process in our namespaces
end_hosts() {
  local ns pids
  for ns in $(ours); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -TERM $pids 2>/dev/null
  done
}

# End the processes inside our namespaces (TERM, then KILL after 5 s), then delete the namespaces;
# a namespace lives on, unnamed, as long as a process runs in it
teardown() {
  local ns left
  [ -n "${ENDER:-}" ] && kill $(pgrep -P "$ENDER") 2>/dev/null  # its sleep: it ends no later run's hosts
  end_hosts
  for _ in $(seq 50); do
    left=$(for ns in $(ours); do ip netns pids "$ns" 2>/dev/null; done)
    [ -z "$left" ] && break
    sleep 0.1
  done
  [ -n "${left:-}" ] && kill -KILL $left 2>/dev/null
  for ns in $(ours); do ip netns del "$ns"; done
}

cannot() { echo "multihost.sh: cannot make network namespaces here: $*" >&2; exit 77; }
command -v ip >/dev/null || cannot "no ip command (iproute2)"
[ -z "$DELAY$RATE" ] || command -v tc >/dev/null || { echo "multihost.sh: -d and -b need tc (iproute2)" >&2; exit 77; }
teardown  # an aborted run's leftovers
OWN_DIR=
[ -n "$DIR" ] || { DIR=$(mktemp -d) && OWN_DIR=1; }
mkdir -p "$DIR"
trap 'teardown; if [ -n "$OWN_DIR" ]; then rm -rf "$DIR"; fi' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The bridge, then each host: its veth made inside it, the peer sent straight to the bridge's namespace
err=$(ip netns add "$BRIDGE" 2>&1 && ip -n "$BRIDGE" link add br0 type bridge 2>&1 &&
      ip -n "$BRIDGE" link set br0 up 2>&1) || cannot "$err"
for ((i = 0; i < HOSTS; i++)); do
  h=$(host $i)
  err=$(ip netns add "$h" 2>&1 &&
        ip -n "$h" link add "veth$i" type veth peer name "port$i" netns "$BRIDGE" 2>&1 &&
        ip -n "$BRIDGE" link set "port$i" master br0 up 2>&1 &&
        ip -n "$h" addr add "$SUBNET.$((i + 1))/24" dev "veth$i" 2>&1 &&
        ip -n "$h" link set "veth$i" up 2>&1 && ip -n "$h" link set lo up 2>&1) || cannot "$err"
  if [ -n "$DELAY" ]; then
    err=$(ip netns exec "$h" tc qdisc add dev "veth$i" root netem delay "$DELAY" ${RATE:+rate $RATE} 2>&1) ||
      { echo "multihost.sh: cannot delay the links (tc netem): $err" >&2; exit 77; }
  elif [ -n "$RATE" ]; then  # a queue deep enough that a burst waits rather than drops
    err=$(ip netns exec "$h" tc qdisc add dev "veth$i" root tbf rate "$RATE" burst 64kb limit 64mb 2>&1) ||
      { echo "multihost.sh: cannot limit the links' rate (tc tbf): $err" >&2; exit 77; }
  fi
done

declare -A host_of  # pid -> host
for ((i = 0; i < HOSTS; i++)); do
  ip netns exec "$(host $i)" env HOST_RANK=$i NUM_HOSTS="$HOSTS" HOST_ADDR="$SUBNET.$((i + 1))" \
    MASTER_ADDR="$SUBNET.1" MASTER_PORT=29400 GLOO_SOCKET_IFNAME="veth$i" \
    timeout -k 10 "$TIMEOUT" bash -c "$COMMAND" >"$DIR/h$i.out" 2>"$DIR/h$i.err" </dev/null &
  host_of[$!]=$i
done
status=0 ENDER=
while ((${#host_of[@]} > 0)); do
  wait -n -p pid "${!host_of[@]}"
  rc=$?
  i=${host_of[$pid]}
  unset "host_of[$pid]"
  echo "$rc" >"$DIR/h$i.status"
  if ((rc != 0 && status == 0)); then
    status=$rc
    { sleep "$GRACE" && end_hosts; } >/dev/null 2>&1 &  # the others' grace
    ENDER=$!
  fi
done
for ((i = 0; i < HOSTS; i++)); do
  ip -n "$(host $i)" -j -s link show "veth$i" >"$DIR/h$i.link" 2>/dev/null
  sed "s/^/[h$i] /" "$DIR/h$i.out"
  sed "s/^/[h$i] /" "$DIR/h$i.err" >&2
done
for ((i = 0; i < HOSTS; i++)); do
  echo "host $i ($SUBNET.$((i + 1))): exit $(cat "$DIR/h$i.status")" >&2
done
exit "$status"
