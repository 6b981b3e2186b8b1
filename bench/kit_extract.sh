# Sourced by the peer kits' scripts (bench/fa3_kit.sh, bench/flashmla_sparse_kit.sh); needs $WORK (a scratch folder).
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
