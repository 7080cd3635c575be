"""The packaged llama.cpp runs on an x86-64 CPU older than the build host's.

The .deb's llama.cpp is built with one CPU backend per x86-64 feature level
(``GGML_BACKEND_DL``, ``GGML_CPU_ALL_VARIANTS``); ``backend._init`` loads the best one
the CPU can run. Here the virtualenv shipped in the built .deb, unpacked with
``dpkg-deb -x``, loads the default model and decodes under ``qemu-x86_64`` emulating
older CPUs: a Westmere (SSE4.2, no AVX) and a Haswell (AVX2 without AVX-512, like the
EPYC machines of this project). A llama.cpp tuned for the build host (``GGML_NATIVE``,
AVX-512 on this machine kind) dies on both with SIGILL.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.package

DEB_DIR = ROOT / "build" / "deb"
N_TOKENS = 8

# Runs inside the packaged virtualenv: greedy decoding through forged's backend, then
# which CPU backend library the process mapped.
PROBE = """
import json, sys
import forged
from forged.engine.backend import Context, ContextParams, Model, Sampler
from forged.engine.request import Sampling
model = Model(sys.argv[1])
ctx = Context(model, ContextParams(n_ctx=256, n_seq_max=1, n_batch=64, threads=2))
sampler = Sampler(model, Sampling(temperature=0.0))
prompt = model.tokenize("def add(a, b):", add_special=True, parse_special=True)
index, tokens = ctx.decode([(0, 0, prompt, True)])[0], []
for i in range(int(sys.argv[2])):
    tokens.append(sampler.sample(ctx, index))
    index = ctx.decode([(0, len(prompt) + i, [tokens[-1]], True)])[0]
with open("/proc/self/maps") as maps:
    cpu = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in maps if "libggml-cpu" in line})
print(json.dumps({"forged": forged.__file__, "tokens": tokens, "cpu_backends": cpu,
                  "text": b"".join(model.piece(t) for t in tokens).decode("utf-8", "replace")}))
"""


@pytest.fixture(scope="module")
def packaged_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    debs = sorted(DEB_DIR.glob("forged_*_amd64.deb"))
    if len(debs) != 1:
        pytest.fail(f"build the packages first (make deb): found {debs} in {DEB_DIR}")
    root = tmp_path_factory.mktemp("deb")
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(root)], check=True, timeout=120)
    # The virtualenv's python links to ../../../bin/python3.11: Debian's, a dependency.
    (root / "usr" / "bin" / "python3.11").symlink_to("/usr/bin/python3.11")
    return root / "usr" / "lib" / "forged"


def test_the_package_ships_every_cpu_variant_and_links_none(packaged_venv: Path) -> None:
    lib = packaged_venv / "lib" / "python3.11" / "site-packages" / "llama_cpp" / "lib"
    variants = {p.name for p in lib.glob("libggml-cpu-*.so")}
    assert {"libggml-cpu-x64.so", "libggml-cpu-sse42.so", "libggml-cpu-haswell.so",
            "libggml-cpu-skylakex.so"} <= variants, variants
    # The AMX variant stopped forged with SIGILL on a Xeon VM that offers AMX in CPUID.
    assert not any(lib.glob("libggml-cpu-sapphirerapids.so*")), variants
    assert not (lib / "libggml-cpu.so").exists()
    needed = subprocess.run(["objdump", "-p", str(lib / "libggml.so")], check=True,
                            capture_output=True, text=True, timeout=30).stdout
    assert "libggml-cpu" not in needed


# qemu's CPU model, and the CPU backend ggml must pick for it.
@pytest.mark.parametrize(("cpu", "variant"), [
    ("Westmere", "libggml-cpu-sse42.so"),
    ("Haswell-noTSX", "libggml-cpu-haswell.so"),
])
def test_decodes_on_an_older_cpu(packaged_venv: Path, real_model: Path, tmp_path: Path,
                                 cpu: str, variant: str) -> None:
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.fail("qemu-x86_64 is missing: run `make deb-deps` (Debian's qemu-user)")
    # -I: the packaged forged, not the checkout's (no current directory on sys.path).
    r = subprocess.run([qemu, "-cpu", cpu, str(packaged_venv / "bin" / "python"), "-I",
                        "-c", PROBE, str(real_model), str(N_TOKENS)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    if r.returncode < 0:
        pytest.fail(f"killed by {signal.Signals(-r.returncode).name} on a {cpu} CPU: "
                    f"{r.stderr[-2000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["forged"].startswith(str(packaged_venv))
    assert out["cpu_backends"] == [variant]
    assert len(out["tokens"]) == N_TOKENS and out["text"].strip()
