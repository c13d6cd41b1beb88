#!/usr/bin/env bash
# Run a command on this machine as if its CPU had AVX2 and no AVX512 / AMX: an AVX2-only host's
# kernels and defaults, measured where no such host is at hand.
#   - torch's own kernels, oneDNN and MKL are capped at AVX2 (ATEN_CPU_CAPABILITY,
#     ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS): bf16 becomes as slow as it is there;
#   - /proc/cpuinfo is replaced, in a private mount namespace, by a copy without the avx512* and
#     amx* flags, so `dtype: auto` picks fp32 and every stage record names an AVX2 machine.
# Needs `unshare` (util-linux) and root, or unprivileged user namespaces.  The clock, caches and
# memory stay this machine's: a real AVX2 host may be slower.
#
#   scripts/as_avx2.sh make repro
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: scripts/as_avx2.sh COMMAND [ARGS...]" >&2; exit 2; }
command -v unshare >/dev/null || { echo "as_avx2: needs unshare (util-linux)" >&2; exit 2; }
flags=$(mktemp "${TMPDIR:-/tmp}/cpuinfo-avx2.XXXXXX")
trap 'rm -f "$flags"' EXIT
sed -E 's/ (avx512[a-z0-9_]*|amx[a-z0-9_]*)//g' /proc/cpuinfo > "$flags"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
[ "$(id -u)" = 0 ] && namespace=(unshare --mount) || namespace=(unshare --map-root-user --mount)
"${namespace[@]}" --propagation private -- bash -c \
    'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$flags" "$@"
