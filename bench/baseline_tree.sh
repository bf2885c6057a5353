#!/usr/bin/env bash
# An earlier commit's collection as its own ansible_collections tree, for an A/B in one GPU run
# (bench/migrate_bench.py --baseline-collections): the tree travels with the device tool's carry.
#   bash bench/baseline_tree.sh <git ref> [dir]     # default dir: .carry-baseline (git-ignored)
set -euo pipefail
ref=${1:?a git ref}
dir=${2:-.carry-baseline}
cd "$(dirname "$0")/.."
rm -rf "$dir"
mkdir -p "$dir/ansible_collections/gpuckpt/fleet"
git archive "$ref" | tar -x -C "$dir/ansible_collections/gpuckpt/fleet"
git rev-parse "$ref" > "$dir/REF"
echo "$dir: $(cat "$dir/REF") ($(du -sh "$dir" | cut -f1))"
