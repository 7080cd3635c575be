#!/bin/sh
# Build forged_<version>_amd64.deb, and with `forged model package`
# forged-model-smollm2_<version>_all.deb and forged-model-minilm_<version>_all.deb (the
# embedding model).
# Usage: scripts/build-deb.sh [OUT_DIR]   (default build/deb)
# Needs: make setup (the dev venv builds the llama-cpp-python wheel, make model and
# make embed-model).
set -eu
cd "$(dirname "$0")/.."
out=${1:-build/deb}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
llama=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
# Not the wheel `make setup` builds: its own folder, so a native wheel is never reused.
wheelhouse=${FORGED_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/forged/wheelhouse-cpu-variants}

# llama-cpp-python is source-only on PyPI: build its wheel once, outside the repo.
# The package must run on any x86-64 CPU, not only on CPUs like the build host's: no
# -march=native, and the CPU backend built once per feature level (SSE4.2, AVX2,
# AVX-512, ...) as loadable modules, of which ggml loads the best the CPU runs
# (forged/engine/backend.py loads them). They install beside libggml in llama_cpp/lib.
# --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and would return the native
# wheel the dev setup built from the same sdist.
if ! ls "$wheelhouse"/llama_cpp_python-"$llama"-*.whl >/dev/null 2>&1; then
    mkdir -p "$wheelhouse"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
-DCMAKE_INSTALL_BINDIR=llama_cpp/lib" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        .venv/bin/pip wheel --quiet --no-cache-dir --no-deps "llama-cpp-python==$llama" \
        -w "$wheelhouse"
fi
wheel=$(ls "$wheelhouse"/llama_cpp_python-"$llama"-*.whl)
# grep reads the whole listing (not -q): an early exit broke zipfile's pipe, noisily.
if ! .venv/bin/python -m zipfile -l "$wheel" | grep '^llama_cpp/lib/libggml-cpu-x64\.so ' >/dev/null; then
    echo "$wheel has no CPU backend variants (a native build?): remove it and rerun" >&2
    exit 1
fi

src=build/deb-src/forged-$version
rm -rf build/deb-src
mkdir -p "$src" "$out"
# The working tree as git sees it (tracked and new files, nothing ignored).
git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$src"
cp -r packaging/debian "$src/debian"
# The man page and bash completion, made from the CLI's parser by the dev venv's
# argparse-manpage and shtab (the package's own virtualenv needs neither).
.venv/bin/python scripts/cli_docs.py "$src/debian/cli"
cp systemd/forged.service systemd/forged.socket systemd/forged.sysusers "$src/debian/"
# dh_installsystemd --name=forged-index finds the index units as debian/forged.forged-index.*
for unit in service timer; do
    cp "systemd/forged-index.$unit" "$src/debian/forged.forged-index.$unit"
done
(cd "$src" && FORGED_WHEELHOUSE="$wheelhouse" dpkg-buildpackage -us -uc -b >../build.log 2>&1) || {
    tail -40 build/deb-src/build.log >&2
    exit 1
}
mv build/deb-src/*.deb "$out/"
# The model packages, as an admin makes one (`forged model package`, README "Day one"):
# the default model's GGUF only (forged.toml's [model] names it), and the embedding
# model with its [[models]] table in /etc/forged/models.d/, served once installed.
maintainer=$(sed -n 's/^Maintainer: //p' packaging/debian/control)
.venv/bin/forged model package models/SmolLM2-135M-Instruct.Q4_1.gguf --id smollm2 \
    --no-config --version "$version" --maintainer "$maintainer" --out "$out"
# Embedding batches of 2,048 tokens, as benchmarked (docs/benchmarks.md, "Embeddings").
.venv/bin/forged model package models/all-MiniLM-L6-v2.f16.gguf --id minilm --role embed \
    --engine step_tokens=2048 --version "$version" --maintainer "$maintainer" --out "$out"
ls -l "$out"/*.deb
