#!/bin/sh
# Builds gpuckpt-cuda-checkpoint from cuda_checkpoint.c: the one recipe for the cuda_checkpoint role
# (on the node) and for the tests (tests/setup.sh). Usage: build.sh SOURCE OUTPUT [CC]
# On x86_64 the binary needs only glibc's oldest symbol versions (see the source's header comment):
# checked here with objdump when it is installed, so a build that would need a newer glibc fails.
set -eu
src=$1 out=$2 cc=${3:-cc}
mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
case "$(uname -m)" in
  x86_64)
    "$cc" -O2 -Wall -Wextra -fPIE -pie -nostartfiles -DGPUCKPT_OLD_GLIBC -o "$tmp" "$src" -ldl
    if command -v objdump >/dev/null 2>&1; then
      newest=$(objdump -T "$tmp" | grep -o 'GLIBC_2\.[0-9.]*' | sort -u -t. -k2,2n -k3,3n | tail -n1)
      case "$newest" in
        GLIBC_2.2.5|GLIBC_2.3|GLIBC_2.3.*|GLIBC_2.[4-9]|GLIBC_2.1[0-7]|"") ;;
        *) echo "build.sh: $out would need $newest; refusing (it must run on old glibc in containers)" >&2; exit 1 ;;
      esac
    fi ;;
  *)
    "$cc" -O2 -Wall -Wextra -o "$tmp" "$src" -ldl ;;
esac
chmod 0755 "$tmp"
mv -f "$tmp" "$out"
trap - EXIT
