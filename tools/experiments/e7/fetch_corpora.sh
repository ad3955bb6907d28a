#!/usr/bin/env bash
# E7's real text in several domains: Debian packages fetched with apt-get download and unpacked
# with dpkg-deb -x (nothing is installed): Jane Austen's novels, the Jargon File, the Linux 6.1
# and Python 3.11 documentation sources. (Python source: the interpreter's own standard library.)
# Usage: bash tools/experiments/e7/fetch_corpora.sh [DEST]   (writes DEST/corpora/<name>)
# Needs `apt-get update` done once, and a python with `rdata` (pip install rdata) for Austen.
# Nothing existing is replaced: an output directory already there stops the script before any
# download; the packages are unpacked in a temporary directory of its own, removed at exit.
set -euo pipefail
DEST=${1:-/work/e7-models}
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
CORPORA="$DEST/corpora"
for name in janeausten jargon linux-doc-6.1-rst python3.11-doc-rst VERSIONS; do
  if [ -e "$CORPORA/$name" ] || [ -L "$CORPORA/$name" ]; then
    echo "fetch_corpora.sh: $CORPORA/$name exists: move it away or give another DEST" >&2
    exit 2
  fi
done
STAGE=$(mktemp -d)  # this script's own: the .deb files and what they unpack to
trap 'rm -rf -- "$STAGE"' EXIT
# the Python docs pinned to the release E7's runs recorded (the security update deb12u9 changed 4
# of the 317 library pages, which moves every validation window: PYTHON_DOC_VERSION= takes the
# newest); the packages' versions are written to CORPORA/VERSIONS
PYTHON_DOC_VERSION=${PYTHON_DOC_VERSION-3.11.2-6+deb12u8}
(cd "$STAGE" && apt-get download r-cran-janeaustenr jargon-text linux-doc-6.1 \
  "python3.11-doc${PYTHON_DOC_VERSION:+=$PYTHON_DOC_VERSION}")
for f in "$STAGE"/*.deb; do
  d="$STAGE/x/$(basename "$f" | cut -d_ -f1)"
  mkdir -p "$d"
  dpkg-deb -x "$f" "$d"
  dpkg-deb -f "$f" Package Version | paste -sd' ' >> "$STAGE/VERSIONS"
done
mkdir -p "$CORPORA"
X="$STAGE/x"
# Jane Austen's 6 novels (R lazy-load DB -> .txt)
$PY "$HERE/extract_austen.py" "$X/r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/data" \
  "$CORPORA/janeausten"
cp "$X/r-cran-janeaustenr/usr/share/doc/r-cran-janeaustenr/copyright" \
  "$CORPORA/janeausten/COPYRIGHT.debian"
# the Jargon File
mkdir "$CORPORA/jargon"
zcat "$X/jargon-text/usr/share/doc/jargon-text/jargon.txt.gz" > "$CORPORA/jargon/jargon.txt"
cp "$X/jargon-text/usr/share/doc/jargon-text/copyright" "$CORPORA/jargon/COPYRIGHT.debian"
# the Linux kernel's and CPython 3.11's documentation (RST sources)
mv "$X/linux-doc-6.1/usr/share/doc/linux-doc-6.1/html/_sources" "$CORPORA/linux-doc-6.1-rst"
mv "$X/python3.11-doc/usr/share/doc/python3.11/html/_sources" "$CORPORA/python3.11-doc-rst"
cp "$X/python3.11-doc/usr/share/doc/python3.11-doc/copyright" \
  "$CORPORA/python3.11-doc-rst/COPYRIGHT.debian"
mv "$STAGE/VERSIONS" "$CORPORA/VERSIONS"
