#!/usr/bin/env bash
# A device call copies the working tree (tracked files, untracked files git does not ignore, the carried
# paths), at most 64 MiB in all; the repository is larger than that (the balanced traces, decision 0002).
# This hides paths a run does not need from git for the time of one or more device calls, and puts them back:
#
#   scripts/device/slim-tree.sh hide PATH...   # git rm --cached PATH (files stay on disk) + .git/info/exclude
#   scripts/device/slim-tree.sh restore        # git reset PATH, the exclude block removed
#   scripts/device/slim-tree.sh size           # MiB that would travel now (without carried paths)
#
# Only the index and .git/info/exclude change; the working tree and uncommitted edits are untouched. Do not
# commit while paths are hidden (the commit would delete them): `restore` first.
set -euo pipefail
cd "$(dirname "$0")/../.."
GIT_DIR=$(git rev-parse --git-dir)
LIST=$GIT_DIR/slim-tree.paths
EXCLUDE=$GIT_DIR/info/exclude

travelling_mib() {
    { git ls-files -z; git ls-files -z --others --exclude-standard; } |
        xargs -0 -r stat -c %s 2> /dev/null | awk '{s += $1} END {printf "%.1f\n", s / 1048576}'
}

case ${1:-} in
hide)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 hide PATH..." >&2; exit 2; }
    [ ! -s "$LIST" ] || { echo "error: paths already hidden ($LIST); run '$0 restore' first" >&2; exit 1; }
    mkdir -p "$(dirname "$EXCLUDE")"
    echo "# slim-tree begin" >> "$EXCLUDE"
    for p in "$@"; do
        git rm -r -q --cached --ignore-unmatch -- "$p"
        echo "/$p" >> "$EXCLUDE"
        echo "$p" >> "$LIST"
    done
    echo "# slim-tree end" >> "$EXCLUDE"
    echo "hidden $# paths; $(travelling_mib) MiB travel now (plus carried paths; at most 64 MiB)"
    ;;
restore)
    if [ -s "$LIST" ]; then
        mapfile -t paths < "$LIST"
        git reset -q -- "${paths[@]}" 2> /dev/null || true
        rm -f "$LIST"
    fi
    [ -f "$EXCLUDE" ] && sed -i '/^# slim-tree begin$/,/^# slim-tree end$/d' "$EXCLUDE"
    echo "restored; $(travelling_mib) MiB would travel"
    ;;
size) echo "$(travelling_mib) MiB travel (plus carried paths; at most 64 MiB)" ;;
*) echo "usage: $0 hide PATH... | restore | size" >&2; exit 2 ;;
esac
