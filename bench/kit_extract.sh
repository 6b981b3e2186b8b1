# Sourced by the peer kits' scripts (bench/fa3_kit.sh, bench/flashmla_sparse_kit.sh); extract needs $WORK (a scratch
# folder).
# pinned_cutlass GIT_DIR COMMIT CUTLASS_GIT_DIR: checks that both are git snapshots holding what the kit needs and prints
# the CUTLASS commit that GIT_DIR's csrc/cutlass submodule pins at COMMIT.
pinned_cutlass() {
    local git=$1 commit=$2 cutlass=$3 pin dir
    for dir in "$git" "$cutlass"; do
        git -C "$dir" rev-parse --git-dir > /dev/null || { echo "not a git directory: $dir" >&2; exit 1; }
    done
    git -C "$git" cat-file -e "$commit^{commit}" || { echo "$git lacks $commit" >&2; exit 1; }
    pin=$(git -C "$git" rev-parse "$commit:csrc/cutlass")
    git -C "$cutlass" cat-file -e "$pin^{commit}" || { echo "$cutlass lacks $pin" >&2; exit 1; }
    echo "$pin"
}

# extract GIT_DIR COMMIT OUT PATH...: git archive of the paths at COMMIT into OUT, checked against the tree's own
# listing (a snapshot may lack large files elsewhere in the tree: git then complains about them on stderr).
extract() {
    local git=$1 commit=$2 out=$3; shift 3
    mkdir -p "$out"
    git -C "$git" archive "$commit" -- "$@" 2> "$WORK/archive.err" | tar -x -C "$out"
    local want got
    want=$(git -C "$git" ls-tree -r --name-only "$commit" -- "$@" | sort)
    got=$(cd "$out" && find . -type f | sed 's|^\./||' | sort)
    [ "$want" = "$got" ] || { echo "extract from $git incomplete" >&2; cat "$WORK/archive.err" >&2; exit 1; }
}
