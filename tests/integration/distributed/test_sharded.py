"""A target sharded over 2 ranks (mx.distributed ring on 127.0.0.1, as `mlx.launch` starts it), speculation on
top: sharded plain decoding equals one-machine plain decoding (float32, greedy), every draft mode over the
sharded target equals sharded plain decoding with exact budgets, and every rank ends holding the same rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.decoding import collect
from tests.fakes.clock import FakeClock
from tests.fakes.tiny_models import tiny_model
from tests.integration.distributed import rank_main
from tests.integration.drafters import helpers

LAUNCH = Path(sys.executable).with_name("mlx.launch")
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed beside this Python")


def launch(tmp: Path, family: str, ranks: int = 2, timeout: float = 240, *extra: str) -> list[dict[str, Any]]:
    model = tiny_model(family, seed=0)
    n = len(model.layers)
    dspark = helpers.write_dspark(
        tmp / "dspark", model, packaging="specforge", layer_ids=(0, n - 1), num_target_layers=n
    )
    dflash = helpers.write_dflash(tmp / "dflash", variant="v2", layer_ids=(0, n - 1), num_target_layers=n, vocab=192)
    cmd = [
        str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--python", sys.executable,
        str(Path(rank_main.__file__)), str(tmp), family, str(dspark), str(dflash), *extra,
    ]  # fmt: skip
    env = {**os.environ, "MLX_DSPARK_ROW_PRODUCTS": "off"}
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = (tmp / f"rank{r}.json" for r in range(ranks))
    return [json.loads(p.read_text()) for p in reports if p.exists()]  # a rank that died wrote none


def one_machine(family: str) -> list[list[int]]:
    out = []
    for prompt, budget in zip(rank_main.PROMPTS, rank_main.BUDGETS):
        target = MlxTargetModel(tiny_model(family, seed=0))
        tokens, _, _ = collect(decode(target, list(prompt), SamplingParams(), StopRule(max_tokens=budget), FakeClock()))
        out.append(tokens)
    return out


@pytest.mark.parametrize("family", ["qwen3"])  # llama: the CLI and serve tests below
def test_sharded_decoding_equals_one_machine_and_speculation_equals_sharded_plain(tmp_path: Path, family: str) -> None:
    rank0, rank1 = launch(tmp_path, family)
    assert (rank0["size"], rank1["size"]) == (2, 2)
    plain = rank0["runs"]["plain"]
    assert plain == one_machine(family)
    for mode, runs in rank0["runs"].items():
        assert runs == plain, mode
        assert [len(r) for r in runs] == list(rank_main.BUDGETS), mode
    assert sum(rank0["rounds"]["lookup"]) < sum(rank0["rounds"]["plain"])  # drafts were accepted: fewer rounds
    assert rank1["served"] > sum(rank0["rounds"]["plain"])  # the worker made every call
    first, again = rank0["sampled"]
    assert first == again and len(first) == 30  # a seed gives the same sampled tokens through the shards
    assert rank0["cached_ids"] == rank1["cached_ids"]  # both ranks committed the same rows, sampled ones too
    prefix = rank0["prefix"]
    assert prefix["source"] == "memory" and prefix["warm"] == prefix["cold"]  # a cached second turn, as if cold
    # The small cache kept one state; every other slot (evicted, or in a cache let go) was dropped on the worker.
    assert prefix["kept"] == 1 and rank1["states_left"] == prefix["kept"]
    print("\nseconds per mode, 2 ranks over loopback:", {k: round(v, 2) for k, v in rank0["seconds"].items()})


def test_a_worker_that_dies_mid_request_ends_it_with_a_clear_error_and_a_restart_serves(tmp_path: Path) -> None:
    (rank0,) = launch(tmp_path / "a", "llama", 2, 120, "chaos")
    assert "lost a rank" in rank0["error"] and "restart every rank" in rank0["error"]
    assert rank0["seconds"] < 10  # the ring reports a closed peer socket at once; no hang
    assert 0 < rank0["tokens"] < 500  # it died mid-request
    assert rank0["after"] == rank0["error"]  # later calls fail fast with the same error
    rank0, _ = launch(tmp_path / "b", "llama")  # a fresh start serves again
    assert rank0["runs"]["lookup"] == rank0["runs"]["plain"]


def test_a_worker_that_hangs_ends_the_request_after_the_rank_timeout(tmp_path: Path) -> None:
    # Its sockets stay open, so no collective fails: only rank 0's bound on the wait ends the request.
    start = time.perf_counter()
    (rank0,) = [r for r in launch(tmp_path, "llama", 2, 120, "hang") if r["rank"] == 0]
    assert "no answer from every rank within 2 s" in rank0["error"] and "restart every rank" in rank0["error"]
    assert rank_main.RANK_TIMEOUT_S <= rank0["seconds"] < rank_main.RANK_TIMEOUT_S + 5  # bounded, not forever
    assert 0 < rank0["tokens"] < 500  # it hung mid-request
    assert rank0["after"] == rank0["error"]  # later calls fail fast with the same error
    assert time.perf_counter() - start < 120


def generate(tmp: Path, model: Path, *flags: str, ranks: int = 0) -> dict[str, Any]:
    cli = [str(Path(sys.executable).with_name("mlx-dspark")), "generate", "--model", str(model), "--json"]
    cli += ["--no-chat-template", "--prompt", "hello world hello world", "--max-tokens", "30"]
    cli += ["--cache-dir", str(tmp / "cache"), *flags]
    if ranks:
        cli = [str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--python", sys.executable, *cli]
    done = subprocess.run(cli, check=False, capture_output=True, text=True, timeout=240, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]  # rank 0 alone prints
    return json.loads(line)


def test_the_cli_generates_on_two_ranks_what_one_process_does(tmp_path: Path) -> None:
    from tests.integration.families.test_family_checkpoints import write_checkpoint
    from tests.integration.hf.tiny_models import vocabulary

    vocab = len(vocabulary())  # the tokenizer's ids all have rows
    model = write_checkpoint(tmp_path / "tiny", "llama", tiny_model("llama", 0, vocab_size=vocab), vocab_size=vocab)
    alone = generate(tmp_path, model, "--mode", "baseline")
    # The draft model (a copy of the target, whole, on rank 0) drafts right: every round verifies a block.
    twin = shutil.copytree(model, tmp_path / "twin")
    flags = ("--mode", "draft", "--draft-model", str(twin), "--distributed", "ring")
    sharded = generate(tmp_path, model, *flags, ranks=2)
    assert sharded["token_ids"] == alone["token_ids"] and sharded["generated_tokens"] == 30
    assert sharded["accepted"] > 0 and sharded["cached_prompt_tokens"] == 0  # speculated; a first request


def test_distributed_without_a_launcher_is_refused_in_words(tmp_path: Path) -> None:
    cli = [str(Path(sys.executable).with_name("mlx-dspark")), "generate", "--model", "default", "--prompt", "hi"]
    cli += ["--distributed", "ring", "--cache-dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    done = subprocess.run(cli, check=False, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 1
    assert "mlx.launch --backend ring" in done.stderr


def test_doctor_reports_the_ranks_the_backend_and_a_call_round_trip(tmp_path: Path) -> None:
    from tests.integration.families.test_family_checkpoints import write_checkpoint

    # Wide enough that its layers' weights dwarf the embedding, which every rank holds whole.
    shape = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_hidden_layers": 8}
    model = write_checkpoint(tmp_path / "tiny", "llama", tiny_model("llama", 0, **shape), **shape)
    full = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    cli = [str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable]
    cli += [str(Path(sys.executable).with_name("mlx-dspark")), "doctor", "--json", "--model", str(model)]
    cli += ["--mode", "lookup", "--distributed", "ring", "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(cli, check=False, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])  # rank 0 alone prints the report
    assert report["distributed"]["ranks"] == 2 and report["distributed"]["backend"] == "ring"
    assert report["distributed"]["call_round_trip_us"] > 0
    assert report["model"].endswith("+tp2")  # its own calibration: the costs include the link
    d = report["distributed"]
    # Rank 0 read only its shard: its load held its half and one layer's whole weights at most, never the model.
    assert 0 < d["shard_bytes"] < 0.6 * full and d["load_peak_bytes"] < 0.75 * full, (d, full)


def test_serve_on_two_ranks_answers_what_one_process_generates(tmp_path: Path) -> None:
    import signal
    import socket
    import time
    import urllib.error
    import urllib.request

    from tests.integration.families.test_family_checkpoints import write_checkpoint
    from tests.integration.hf.tiny_models import vocabulary

    vocab = len(vocabulary())
    model = write_checkpoint(tmp_path / "tiny", "llama", tiny_model("llama", 0, vocab_size=vocab), vocab_size=vocab)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = [str(LAUNCH), "--backend", "ring", "-n", "2", "--python", sys.executable]
    cli += [str(Path(sys.executable).with_name("mlx-dspark")), "serve", "--model", str(model), "--mode", "lookup"]
    cli += ["--distributed", "ring", "--port", str(port), "--warmup", "off", "--cache-dir", str(tmp_path / "cache")]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(cli, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def post(body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{base}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        body = {"model": str(model), "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 24}
        sharded = post(body)
        # One process, plain decoding, the same chat through the same family codec.
        cli = [str(Path(sys.executable).with_name("mlx-dspark")), "generate", "--model", str(model), "--json"]
        cli += ["--prompt", "hello world", "--max-tokens", "24", "--mode", "baseline"]
        cli += ["--cache-dir", str(tmp_path / "cache")]
        done = subprocess.run(cli, check=False, capture_output=True, text=True, timeout=240, cwd=tmp_path)
        alone = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("{")))
        assert sharded["choices"][0]["message"]["content"] == alone["text"]
        assert sharded["usage"]["completion_tokens"] == alone["generated_tokens"]
        # Another conversation, then the first again: its prefix comes from the shards' saved states.
        post({**body, "messages": [{"role": "user", "content": "world hello world hello"}]})
        again = post(body)
        assert again["choices"][0]["message"]["content"] == alone["text"]
        # All but the prompt's last token (the live rows are the other conversation's: they share only the header).
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
