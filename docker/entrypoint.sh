#!/bin/sh
# Container entrypoint: every argument goes to the mapl-swarm CLI (dht, peer, prepare, train...).
set -e
exec mapl-swarm "$@"
