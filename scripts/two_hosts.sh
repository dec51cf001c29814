#!/usr/bin/env bash
# Launch one host's part of a two-machine run on this box: in network namespace qhostK (scripts/netns.sh up),
# `accelerate launch` with configs/accelerate/two_hosts_gloo.yaml as machine K of 2, gloo on that host's veth.
# Start it once per host, with the same port and command:
#
#   scripts/two_hosts.sh 0 29531 -m quartet.cli ppo -c ppo.yaml &
#   scripts/two_hosts.sh 1 29531 -m quartet.cli ppo -c ppo.yaml; wait
#
# PYTHON (default .venv/bin/python, else python3) runs accelerate. QUARTET_RDZV_TIMEOUT (whole seconds, default 600,
# torch's) bounds how long each host waits for the other at start; QUARTET_DIST_TIMEOUT how long a process waits
# for a silent peer during the run (docs/scaling.md).
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 RANK PORT (-m module | script.py) [args...]" >&2
    exit 2
fi
rank=$1 port=$2
shift 2
case "$rank" in 0|1) ;; *) echo "error: RANK must be 0 or 1, got $rank" >&2; exit 2 ;; esac
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$([ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3)}"
timeout="${QUARTET_RDZV_TIMEOUT:-600}"
case "$timeout" in
    ''|*[!0-9]*) echo "error: QUARTET_RDZV_TIMEOUT must be whole seconds, got $timeout" >&2; exit 2 ;;
esac
if [ "$rank" != 0 ]; then
    # wait for the main host's rendezvous port here, so that an absent or unreachable main host is one error line,
    # not a C++ trace of torch's TCPStore client after the same wait
    if ! ip netns exec "qhost$rank" bash -c '
        deadline=$(( ${EPOCHREALTIME/./} + $1 * 1000000 ))
        until timeout 2 bash -c "exec 3<>/dev/tcp/10.231.0.1/$2" 2>/dev/null; do
            [ "${EPOCHREALTIME/./}" -lt "$deadline" ] || exit 1
            sleep 0.2
        done' probe "$timeout" "$port"; then
        echo "error: host $rank: the main host 10.231.0.1:$port did not answer within $timeout s" \
             "(QUARTET_RDZV_TIMEOUT): start host 0 with the same port, and check that this host reaches its address" >&2
        exit 2
    fi
fi
exec ip netns exec "qhost$rank" env GLOO_SOCKET_IFNAME="qveth$rank" \
    "$python" -m accelerate.commands.launch --config_file "$here/configs/accelerate/two_hosts_gloo.yaml" \
    --machine_rank "$rank" --main_process_ip 10.231.0.1 --main_process_port "$port" \
    --rdzv_conf "timeout=$timeout" "$@"
