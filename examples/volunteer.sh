#!/usr/bin/env bash
# Join a swarm as a volunteer rollout peer. Usage:
#   examples/volunteer.sh /ip4/HOST/tcp/PORT/p2p/BOOTSTRAP_ID TRAINER_PEER_ID [REGION]
# Listens on loopback unless SWARM_LISTEN says otherwise: others can dial a peer only
# on a reachable address, e.g. SWARM_LISTEN=/ip4/0.0.0.0/tcp/4002 (open that port).
set -euo pipefail
bootstrap=${1:?bootstrap multiaddr}
trainer=${2:?trainer peer id}
region=${3:-}
exec swarm peer --bootstrap "$bootstrap" --trainer "$trainer" --region "$region" \
    --listen "${SWARM_LISTEN:-/ip4/127.0.0.1/tcp/0}" --data-dir "${SWARM_DATA_DIR:-$HOME/.swarm}"
