#!/usr/bin/env bash
# Two hosts on one Linux box, for the two-machine launch and its tests (tests/distributed/test_two_hosts.py):
# network namespaces qhost0 and qhost1 joined by a veth pair, qveth0 (in qhost0, 10.231.0.1, the main host) and
# qveth1 (in qhost1, 10.231.0.2), a /30 of their own. Each has its loopback up and no default route, so a process
# in one namespace reaches the other's address and nothing else: every byte between the two hosts crosses the veth.
#
#   scripts/netns.sh up       # create what is missing (idempotent); needs root (CAP_NET_ADMIN) and iproute2
#   scripts/netns.sh down     # remove both namespaces (deleting one deletes its veth end, and so the pair)
#   scripts/netns.sh status   # exit 0 when both are up as above, 1 otherwise, and say which
#
# Run something on host K: `ip netns exec qhostK <command>`; scripts/two_hosts.sh does it for accelerate. Inside,
# /etc/hosts is this box's plus the pair's names (/etc/netns/qhostK/hosts, which `ip netns exec` mounts there), so
# the peer's address has a name without a DNS server to ask (torch's store logs a warning for each failed lookup).
set -euo pipefail

PREFIX=qhost
VETH=qveth
SUBNET=10.231.0   # 10.231.0.0/30: .1 is host 0, .2 host 1 (a block no cloud, container or VPN default uses)

addr() { echo "$SUBNET.$(($1 + 1))"; }

up() {
    for k in 0 1; do
        ip netns list | grep -qw "$PREFIX$k" || ip netns add "$PREFIX$k"
    done
    if ! ip -n "${PREFIX}0" link show "${VETH}0" >/dev/null 2>&1; then
        ip -n "${PREFIX}1" link del "${VETH}1" 2>/dev/null || true  # the other end of a half-made pair
        ip link add "${VETH}0" netns "${PREFIX}0" type veth peer name "${VETH}1" netns "${PREFIX}1"
    fi
    for k in 0 1; do
        ip -n "$PREFIX$k" link set lo up
        ip -n "$PREFIX$k" addr replace "$(addr "$k")/30" dev "$VETH$k"
        ip -n "$PREFIX$k" link set "$VETH$k" up
        mkdir -p "/etc/netns/$PREFIX$k"
        { cat /etc/hosts; echo "$(addr 0) ${PREFIX}0"; echo "$(addr 1) ${PREFIX}1"; } > "/etc/netns/$PREFIX$k/hosts"
    done
}

down() {
    for k in 0 1; do
        if ip netns list | grep -qw "$PREFIX$k"; then ip netns del "$PREFIX$k"; fi
        rm -rf "/etc/netns/$PREFIX$k"
    done
    rmdir /etc/netns 2>/dev/null || true  # when no other namespace has files there
}

status() {
    local ok=0
    for k in 0 1; do
        if ! ip netns list | grep -qw "$PREFIX$k"; then
            echo "$PREFIX$k: absent"; ok=1; continue
        fi
        if ! ip -n "$PREFIX$k" -br addr show dev "$VETH$k" 2>/dev/null | grep -q "UP.* $(addr "$k")/30"; then
            echo "$PREFIX$k: $VETH$k is not up with $(addr "$k")/30"; ok=1; continue
        fi
        if ip -n "$PREFIX$k" route show default | grep -q .; then
            echo "$PREFIX$k: has a default route (traffic could leave the pair)"; ok=1; continue
        fi
        echo "$PREFIX$k: $VETH$k $(addr "$k")/30 up, no default route"
    done
    return $ok
}

case "${1:-}" in
    up) up; status ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
