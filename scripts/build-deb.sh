#!/bin/sh
# Build forged_<version>_amd64.deb and forged-model-smollm2_<version>_all.deb.
# Usage: scripts/build-deb.sh [OUT_DIR]   (default build/deb)
# Needs: make setup (the dev venv builds the llama-cpp-python wheel) and make model.
set -eu
cd "$(dirname "$0")/.."
out=${1:-build/deb}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
llama=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
wheelhouse=${FORGED_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/forged/wheelhouse}

# llama-cpp-python is source-only on PyPI: build its wheel once, outside the repo.
if ! ls "$wheelhouse"/llama_cpp_python-"$llama"-*.whl >/dev/null 2>&1; then
    mkdir -p "$wheelhouse"
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        .venv/bin/pip wheel --quiet --no-deps "llama-cpp-python==$llama" -w "$wheelhouse"
fi

src=build/deb-src/forged-$version
rm -rf build/deb-src
mkdir -p "$src" "$out"
# The working tree as git sees it (tracked and new files, nothing ignored).
git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$src"
cp -r packaging/debian "$src/debian"
cp systemd/forged.service systemd/forged.socket systemd/forged.sysusers "$src/debian/"
mkdir -p "$src/models"
cp models/SmolLM2-135M-Instruct.Q4_1.gguf "$src/models/"
(cd "$src" && FORGED_WHEELHOUSE="$wheelhouse" dpkg-buildpackage -us -uc -b >../build.log 2>&1) || {
    tail -40 build/deb-src/build.log >&2
    exit 1
}
mv build/deb-src/*.deb "$out/"
ls -l "$out"/*.deb
