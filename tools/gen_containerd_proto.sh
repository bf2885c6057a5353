#!/usr/bin/env bash
# Generates plugins/module_utils/runtimes/containerd_proto/: the Python messages (*_pb2.py) and gRPC stubs
# (*_pb2_grpc.py) of the containerd API calls that runtimes/containerd_api.py makes, from containerd's own
# .proto files. Re-runnable; the output replaces the package's generated files.
#
#   tools/gen_containerd_proto.sh SOURCE
#
# SOURCE: containerd's source tree (the directory holding api/), or its tarball. The files committed were made
# from Debian's containerd 2.1.9+ds1 source (containerd_2.1.9+ds1.orig.tar.xz, as `apt-get source
# --download-only containerd` fetches it from Debian sid; upstream's tag v2.1.9 has the same api/). containerd
# 2.x's .proto files import no gogoproto options, so nothing is stripped. Their v1 services are containerd
# 1.6's and 1.7's with fields added (Container.sandbox, runc's task_api_address, ...), the field numbers
# unchanged: the same stubs talk to containerd 1.6, 1.7 and 2.x.
#
# The compiler: grpcio-tools 1.51.x (its protoc 3.21), from $PYTHON when that Python has that version, else a
# throwaway venv. protoc 3.21's output imports under protobuf's Python runtime 4.21 (Debian bookworm's
# python3-protobuf 3.21.12) and every newer one (5.x, 6.x), and its stubs under grpcio 1.51 (bookworm) and
# newer; a newer grpcio-tools would emit code that refuses the older runtimes.
#
# protoc names the modules after the .proto files' import paths (`from github.com.containerd... import`):
# the package is flat (every file's base name is unique), and those imports are rewritten to relative ones
# (`from . import mount_pb2`), which Ansible's module packaging follows into the module's payload.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/plugins/module_utils/runtimes/containerd_proto"
GRPCIO_TOOLS="grpcio-tools==1.51.3"
# What containerd_api.py calls, and what those import (google/protobuf/* comes with grpc_tools).
PROTOS=(
  api/services/containers/v1/containers.proto
  api/services/namespaces/v1/namespace.proto
  api/services/snapshots/v1/snapshots.proto
  api/services/tasks/v1/tasks.proto
  api/services/version/v1/version.proto
  api/types/descriptor.proto
  api/types/metrics.proto
  api/types/mount.proto
  api/types/task/task.proto
  api/types/runc/options/oci.proto
)

[ $# -eq 1 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=$1
if [ -f "$src" ]; then
  mkdir "$work/src"
  tar -xf "$src" -C "$work/src"
  services=$(find "$work/src" -maxdepth 3 -path '*/api/services' -type d | head -n1)
  src=$(dirname "$(dirname "${services:-$work/src/none/api/services}")")
fi
[ -d "$src/api/services" ] || { echo "no containerd source (api/services) in $1" >&2; exit 1; }
version=$(sed -n 's/^[[:space:]]*Version = "\([^"+]*\).*"/\1/p' "$src/version/version.go" 2>/dev/null | head -n1)

python=${PYTHON:-python3}
if ! "$python" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("grpcio-tools").startswith("1.51."))' \
    2>/dev/null; then
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install -q "$GRPCIO_TOOLS"
  python="$work/venv/bin/python"
fi
tools_version=$("$python" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))')
protoc_version=$("$python" -m grpc_tools.protoc --version)

# The .proto files at the paths they import each other by.
inc="$work/include/github.com/containerd/containerd"
for p in "${PROTOS[@]}"; do
  mkdir -p "$inc/$(dirname "$p")"
  cp "$src/$p" "$inc/$p"
done
wkt=$("$python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
mkdir "$work/gen"
(cd "$work/include" && "$python" -m grpc_tools.protoc -I. -I"$wkt" --python_out="$work/gen" \
  --grpc_python_out="$work/gen" "${PROTOS[@]/#/github.com/containerd/containerd/}")

# Flat, with relative imports, each file headed by its .proto's copyright notice (Apache-2.0).
rm -f "$out"/*_pb2.py "$out"/*_pb2_grpc.py
mkdir -p "$out"
for p in "${PROTOS[@]}"; do
  base=$(basename "$p" .proto)
  for suffix in _pb2 _pb2_grpc; do
    gen="$work/gen/github/com/containerd/containerd/${p%.proto}$suffix.py"
    [ -f "$gen" ] || gen="$work/gen/github.com/containerd/containerd/${p%.proto}$suffix.py"
    [ -f "$gen" ] || continue
    dest="$out/$base$suffix.py"
    [ ! -e "$dest" ] || { echo "two .proto files named $base" >&2; exit 1; }
    if [ "$suffix" = _pb2_grpc ] && ! grep -q '^class ' "$gen"; then
      continue  # no service in this file: protoc writes an empty stub module
    fi
    {
      sed -n '1{/coding/p}' "$gen"
      sed -n '/^\/\*/,/\*\//p' "$src/$p" | sed -e '/^\/\*$/d' -e '/^\*\/$/d' -e 's/^\t\{0,1\}/# /' -e 's/[[:space:]]*$//'
      echo "# Generated from containerd ${version:-(version unknown)}'s $p by grpcio-tools $tools_version"
      echo "# (${protoc_version}) with tools/gen_containerd_proto.sh: edit that, not this file."
      sed -E -e '1{/coding/d}' -e "s/(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'[^']*'/\1__name__/" -e 's/^from github\.com\.containerd\.containerd\.[A-Za-z0-9_.]+ import ([A-Za-z0-9_]+_pb2) as /from . import \1 as /' "$gen"
    } > "$dest"
    if grep -nE '^(from|import) github' "$dest"; then
      echo "$dest: an import left unrewritten" >&2
      exit 1
    fi
  done
done
: > "$out/__init__.py"  # empty, as ansible-test's empty-init asks of module_utils packages (README.md says what this is)
{
  echo "# containerd_proto: generated code, do not edit"
  echo
  echo "The Python messages (\`*_pb2.py\`) and gRPC client stubs (\`*_pb2_grpc.py\`) of the containerd API calls that"
  echo "\`runtimes/containerd_api.py\` makes, generated by \`tools/gen_containerd_proto.sh\` (run it again to regenerate;"
  echo "it says where the sources come from)."
  echo
  echo "- Source: containerd ${version:-?}'s .proto files (Debian's containerd source package, \`containerd_${version:-?}+ds1.orig.tar.xz\`;"
  echo "  upstream tag v${version:-?} has the same \`api/\`):"
  for p in "${PROTOS[@]}"; do echo "  - \`$p\`"; done
  echo "- Compiler: grpcio-tools $tools_version ($protoc_version). Its output imports under protobuf's Python runtime 4.21"
  echo "  (Debian 12's python3-protobuf 3.21.12) and newer, with grpcio 1.51 (Debian 12's python3-grpcio) and newer."
  echo "  Why 2.x's files and not Debian 12's containerd 1.6.20: they are a superset of the same v1 services, with"
  echo "  the same field numbers, and 1.6's Container has no \`sandbox\` field (1.7 added it), which the backend keeps."
  echo "  The same stubs talk to containerd 1.6, 1.7 and 2.x."
  echo "- Changes to protoc's output: one flat package, its imports of other containerd files made relative"
  echo "  (\`from . import mount_pb2\`), the messages' module named \`__name__\` (protoc writes the import path);"
  echo "  each file headed by its .proto's copyright notice. No option was stripped (containerd 2.x's .proto"
  echo "  files use no gogoproto)."
  echo "- License: containerd is Copyright The containerd Authors, under the Apache License 2.0 (\`LICENSE\`, \`NOTICE\`"
  echo "  here). The rest of this collection is GPL-3.0-or-later, with which Apache-2.0 code may be combined."
} > "$out/README.md"
cp "$src/LICENSE" "$out/LICENSE"
[ ! -f "$src/NOTICE" ] || cp "$src/NOTICE" "$out/NOTICE"
echo "generated $(ls "$out"/*_pb2*.py | wc -l) modules into $out from containerd ${version:-?} ($tools_version, $protoc_version)"
