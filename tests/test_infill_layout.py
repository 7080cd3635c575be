"""forged's /infill prompt against llama.cpp's own server, built from the sources of
the llama-cpp-python that forged pins (bench/build-llama-server.sh: a few minutes on a
fresh machine, cached after). For each request both servers get, llama-server reports
the prompt it built (``prompt``: its tokens detokenized with special tokens written
out) and its length (``tokens_evaluated``); forged's layout of the same request must
give the same text from the same number of tokens.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.daemonproc import free_port
from forged.engine.fim import ExtraFile
from forged.engine.prompts import Prompter
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

N_BATCH, N_CTX, N_PREDICT = 256, 1024, 8  # small, so that the budgets clip
LONG = "".join(f"    x{i} = compute({i}, y)\n" for i in range(120))
CASES: list[dict[str, Any]] = [
    {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n"},
    {"input_prefix": "import os\n", "input_suffix": "", "prompt": "os.pa"},
    {"input_prefix": "x = 1\n", "input_suffix": "y = 2\n",
     "input_extra": [{"filename": "util.py", "text": "def helper():\n    pass\n"},
                     {"filename": "b/c.py", "text": "CONST = 3\n"}]},
    # a long file before and after the cursor: the prefix keeps its end, the suffix its
    # start, and the extra context what is left of the context, from its end
    {"input_prefix": LONG, "input_suffix": LONG, "prompt": "z = ",
     "input_extra": [{"filename": "big.py", "text": LONG}]},
    # llama.cpp's mixed form: text and token ids
    {"input_prefix": ["def f():", 35], "input_suffix": "pass\n"},
]


@pytest.fixture(scope="module")
def llama_server(fim_model: Path) -> Iterator[str]:
    built = subprocess.run(["sh", "bench/build-llama-server.sh"], cwd=ROOT, check=True,
                           capture_output=True, text=True, timeout=3600)
    binary = built.stdout.strip().splitlines()[-1]
    port = free_port()
    proc = subprocess.Popen(
        [binary, "-m", str(fim_model), "--host", "127.0.0.1", "--port", str(port),
         "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_BATCH), "-np", "1",
         "-n", str(N_PREDICT), "-t", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "llama-server"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("case", CASES, ids=["plain", "typed", "extra", "clipped", "mixed"])
def test_forged_lays_out_the_infill_prompt_as_llama_server_does(
        case: dict[str, Any], llama_server: str, fim_model: Path) -> None:
    r = httpx.post(llama_server + "/infill", json={**case, "n_predict": N_PREDICT,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    theirs = r.json()
    p = Prompter(str(fim_model))
    try:
        extra = [ExtraFile(**x) for x in case.get("input_extra", [])]
        ours = p.encode_infill(case["input_prefix"], case["input_suffix"], extra,
                               case.get("prompt", ""), n_batch=N_BATCH, n_ctx=N_CTX,
                               n_predict=N_PREDICT, room=N_PREDICT)
        assert theirs["tokens_evaluated"] == len(ours)
        assert theirs["prompt"] == p.vocab.detokenize(ours)
    finally:
        p.close()
