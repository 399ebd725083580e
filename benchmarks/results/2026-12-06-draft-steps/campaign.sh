#!/usr/bin/env bash
# tercet and llama-server on the AVX2 EPYC, one server at a time, the order reversed each round:
# ../2026-12-06-epyc/campaign.sh with SERVERS="tercet llama" and OUT here.
#
#   benchmarks/results/2026-12-06-octet-pairs/campaign.sh ROUNDS [CONCURRENCY...]   (this folder: 2 1 8)
HERE=$(cd "$(dirname "$0")" && pwd)
SERVERS=${SERVERS:-tercet llama} OUT=$HERE exec "$HERE/../2026-12-06-epyc/campaign.sh" "$@"
