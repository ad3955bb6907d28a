#!/usr/bin/env bash
# E7's real text in several domains: Debian packages fetched with apt-get download and unpacked
# with dpkg-deb -x (nothing is installed): Jane Austen's novels, the Jargon File, the Linux 6.1
# and Python 3.11 documentation sources. (Python source: the interpreter's own standard library.)
# Usage: bash fetch_corpora.sh [DEST]  ; needs `apt-get update` done once, and a python with `rdata` (pip install rdata) for Austen.
set -euo pipefail
DEST=${1:-/work/e7-models}
PY=${PY:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DEST"/corpora/deb "$DEST"/corpora/x && cd "$DEST"/corpora/deb
apt-get download r-cran-janeaustenr jargon-text linux-doc-6.1 python3.11-doc
cd ..
for f in deb/*.deb; do d=x/$(basename "$f" | cut -d_ -f1); mkdir -p "$d"; dpkg-deb -x "$f" "$d"; done
# Jane Austen's 6 novels (R lazy-load DB -> .txt)
$PY "$HERE"/extract_austen.py x/r-cran-janeaustenr/usr/lib/R/site-library/janeaustenr/data janeausten
cp x/r-cran-janeaustenr/usr/share/doc/r-cran-janeaustenr/copyright janeausten/COPYRIGHT.debian
# Jargon File
mkdir -p jargon && zcat x/jargon-text/usr/share/doc/jargon-text/jargon.txt.gz > jargon/jargon.txt
cp x/jargon-text/usr/share/doc/jargon-text/copyright jargon/COPYRIGHT.debian
# Linux kernel docs (RST sources) and CPython 3.11 docs (RST sources)
rm -rf linux-doc-6.1-rst python3.11-doc-rst
mv x/linux-doc-6.1/usr/share/doc/linux-doc-6.1/html/_sources linux-doc-6.1-rst
mv x/python3.11-doc/usr/share/doc/python3.11/html/_sources python3.11-doc-rst
cp x/python3.11-doc/usr/share/doc/python3.11-doc/copyright python3.11-doc-rst/COPYRIGHT.debian
rm -rf x
