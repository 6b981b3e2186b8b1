#!/usr/bin/env bash
# Each patch in lab/patches (or bench/patches) applied alone to HEAD, for a device call to test and
# time side by side: DEST/variants/ID.py (the patched submission.py, for serving_peers.py --variant)
# and DEST/trees/ID/ (only the files the patch changes, at their paths, to lay over a copy of the
# repository for its tests).
#
#   bash lab/device/make_variants.sh DEST PATCH...
set -euo pipefail
DEST=$(realpath -m "${1:?usage: make_variants.sh DEST PATCH...}"); shift
ROOT=$(git rev-parse --show-toplevel)
mkdir -p "$DEST/variants" "$DEST/trees"
for patch in "$@"; do
    id=$(basename "$patch" | cut -d_ -f1)
    abs=$(realpath "$patch")
    work=$(mktemp -d)
    git -C "$ROOT" archive HEAD | tar -x -C "$work"
    (cd "$work" && git apply "$abs")
    cp "$work/submission.py" "$DEST/variants/$id.py"
    grep '^+++ b/' "$patch" | cut -c7- | while read -r path; do
        mkdir -p "$DEST/trees/$id/$(dirname "$path")"
        cp "$work/$path" "$DEST/trees/$id/$path"
    done
    rm -rf "$work"
    echo "$id: $(grep -c '^+++ b/' "$patch") files"
done
